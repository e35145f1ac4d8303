"""Peers' bytes checked against digests bound to the origin's version: a forged block (modelled as one whose
format-1 digest matches), a stale digest file (an old version replayed under the new version's tag, an honest
peer of the new version), and the unverified opt-in that must never leave a copy a later load trusts."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

import streamload
from streamload.integrity.digests import DIGEST_FILE
from streamload.storage import cache as cache_module
from streamload.storage.peers import TALLY

from .test_peers import (
    Store,
    _asked,
    _copy_cache,
    _covered,
    _flipped,
    _vouch,
    assert_same,
    own_store,
    publish_digests,
    seeders,
    warnings_of,
)
from .test_peers import (
    quick as quick,  # the peers' quick timeouts: the autouse fixture, found here too
)

SHARD = "model-00002-of-00003.safetensors"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A store of this test's own (the tests change its objects and digest file)."""
    yield from own_store(tmp_path)


def format_1(folder: Path, files: dict[str, Path]) -> None:
    """A format-1 digest file (xxh3-64 blocks) of `files` (name: the bytes to describe) in `folder`."""
    doc: dict = {"format": "streamload-digests/1", "block_bytes": 1 << 20, "files": {}}
    for name, path in files.items():
        header = streamload.inspect(path).files[0]
        raw = path.read_bytes()
        tensors = {t.name: [xxhash.xxh3_64_hexdigest(raw[a : min(a + (1 << 20), t.end)])
                            for a in range(t.begin, t.end, 1 << 20)] for t in header.tensors}  # fmt: skip
        doc["files"][name] = {"size": len(raw), "header_sha256": hashlib.sha256(raw[: header.data_start]).hexdigest(),
                              "tensors": tensors}  # fmt: skip
    (folder / DIGEST_FILE).write_text(json.dumps(doc))


def a_new_version(path: Path) -> None:
    """The file at `path` rewritten as the next training step: the same header (names, dtypes, shapes,
    offsets, so the same size and header digest), other values, a new modification time (a new ETag)."""
    state = load_file(path)
    header = streamload.inspect(path).files[0]
    raw = bytearray(path.read_bytes())
    for t in header.tensors:
        if t.nbytes:
            values = (state[t.name].float() + 1).to(state[t.name].dtype)
            raw[t.begin : t.end] = values.contiguous().view(torch.uint8).numpy().tobytes()
    time.sleep(0.01)
    path.write_bytes(bytes(raw))


def copy_of(cache: Path, name: str = SHARD) -> Path:
    return next(cache.rglob(f"model/{name}"))


def test_a_forged_block_whose_format_1_digest_matches_is_never_handed_out(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer's block was changed so that its xxh3-64 is the published one (a collision, computed in a
    minute for xxh3): format 1 is no proof, peers are not used on it; with format 2 the block is caught."""
    bad = _flipped(store, tmp_path / "bad")
    format_1(store.www / "model", {p.name: (copy_of(bad, p.name)) for p in store.copies()})
    with seeders(bad) as (liar,):
        got = streamload.load(store.url, device="cpu", peers=[liar.url])
        assert_same(got, store.www / "model")
        said = warnings_of(caplog)
        assert len(said) == 1 and "format 1" in said[0] and liar.requests == [], said
        caplog.clear()
        publish_digests(store.url, store.www / "model")
        got = streamload.load(store.url, device="cpu", peers=[liar.url], verify=True)
        assert_same(got, store.www / "model")
        named = [w for w in warnings_of(caplog) if liar.url in w]
        assert len(named) == 1 and "layers.1.w1" in named[0], warnings_of(caplog)


def test_an_old_version_replayed_under_the_new_tag_is_not_taken(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The digest file was made from version 1; the store now holds version 2 (the same size and header).
    A peer replaying version 1 under version 2's tag must not be believed because its blocks match the old
    digests; an honest peer of version 2 must not be called a liar."""
    publish_digests(store.url, store.www / "model")  # bound to version 1's ETags
    liar = _copy_cache(store, tmp_path / "liar")  # version 1's bytes
    a_new_version(store.www / "model" / SHARD)
    honest = tmp_path / "honest"
    streamload.load(store.url, device="cpu", cache_dir=honest)  # version 2's bytes, recorded as such
    new_record = json.loads(Path(f"{copy_of(honest)}{cache_module.RECORD}").read_text())
    _vouch(copy_of(liar), version=new_record["version"])  # version 1's bytes under version 2's tag
    caplog.clear()
    with seeders(liar) as (lying,), seeders(honest) as (fair,):
        got = streamload.load(store.url, device="cpu", peers=[lying.url])
        assert_same(got, store.www / "model")
        said = warnings_of(caplog)
        assert len(said) == 1 and SHARD in said[0] and "another version" in said[0], said
        caplog.clear()
        got = streamload.load(store.url, device="cpu", peers=[fair.url])
        assert_same(got, store.www / "model")
        assert not [w for w in warnings_of(caplog) if fair.url in w], warnings_of(caplog)  # not blamed


def test_a_digest_file_that_fails_the_origin_too_is_stale_and_the_peer_not_blamed(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry that names the origin's version but whose blocks are another version's (a publisher's slip):
    the peer's block fails, the origin's fails too: one warning naming the digest file, the peer kept."""
    publish_digests(store.url, store.www / "model")
    old = json.loads((store.www / "model" / DIGEST_FILE).read_text())
    a_new_version(store.www / "model" / SHARD)
    publish_digests(store.url, store.www / "model")
    doc = json.loads((store.www / "model" / DIGEST_FILE).read_text())
    doc["files"][SHARD]["tensors"] = old["files"][SHARD]["tensors"]  # version 1's blocks under version 2's ETag
    (store.www / "model" / DIGEST_FILE).write_text(json.dumps(doc))
    honest = tmp_path / "honest"
    streamload.load(store.url, device="cpu", cache_dir=honest)
    caplog.clear()
    with seeders(honest) as (fair,):
        before = TALLY.read()[0]
        got = streamload.load(store.url, device="cpu", peers=[fair.url])
        assert_same(got, store.www / "model")
        said = warnings_of(caplog)
        assert len(said) == 1 and "stale" in said[0] and DIGEST_FILE in said[0] and fair.url not in said[0], said
        assert fair.sent > 0  # still served the other files
        # the stale block's bytes were taken from the source: not counted as the peer's
        assert 0 < TALLY.read()[0] - before < fair.sent


def test_unchecked_peer_bytes_never_become_a_kept_copy(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STREAMLOAD_PEERS_UNVERIFIED=1 with a lying peer: whatever that load got, its cache keeps no copy made
    of the peer's bytes; a later load without peers and without the opt-in is exact and asks the store."""
    bad = _copy_cache(store, tmp_path / "bad")
    lied = next(bad.rglob(f"bare/{SHARD}"))
    info = streamload.inspect(lied).tensors["layers.1.w1"]
    with open(lied, "r+b") as f:
        f.seek(info.begin + 1000)
        f.write(b"\xff" * 64)
    _vouch(lied)
    monkeypatch.setenv("STREAMLOAD_PEERS_UNVERIFIED", "1")
    joiner = tmp_path / "joiner"
    with seeders(bad) as (liar,), caplog.at_level(logging.INFO, "streamload"):
        streamload.load(store.bare, device="cpu", peers=[liar.url], cache_dir=joiner)
        assert liar.sent > 0
    kept = [p for p in joiner.rglob("*.safetensors") if Path(f"{p}{cache_module.RECORD}").exists()]
    assert not kept, kept
    monkeypatch.delenv("STREAMLOAD_PEERS_UNVERIFIED")
    before = len(store.server.requests)
    got = streamload.load(store.bare, device="cpu", cache_dir=joiner)
    assert_same(got, store.www / "bare")
    asked = _asked(store.server.requests[before:])
    for header in streamload.inspect(store.www / "bare").files:  # every tensor byte asked of the store again
        assert _covered(asked.get(header.path.name, []), header.data_start, header.size), header.path.name
