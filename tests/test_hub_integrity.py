"""A hub download's bytes are handed out only as its SHA-256 allows (storage/hub.py, integrity/whole.py): the
stand-in hub of tests/test_hub.py, its CDN serving a file with one byte flipped (a flaky proxy, a wrong
mirror) or resuming a partial file whose tail a crash left zeroed. `load`, `load_into` and `from_pretrained`
raise IntegrityError naming the file and the repo; `iter` fails at the damaged file's end (with `verify=True`
before any tensor of it); nothing of the file is left where a later load would take it, and that load, from a
mended server, is exact."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import streamload
from streamload.base.errors import IntegrityError, MissingFileError

from .test_hub import COMMIT, REPO, StandIn, _downloads_ended, _online, _original, _same
from .test_hub import hub as hub  # the fixture: the stand-in, online, with a hub cache of the test's own

FIRST = "model-00001-of-00002.safetensors"  # holds model.layers.10 .. 13
SECOND = "model-00002-of-00002.safetensors"
DAMAGED = "model.layers.11.weight"


def _flip(hub: StandIn, name: str = FIRST, tensor: str = DAMAGED) -> bytes:
    """The CDN serves `name` with one byte of `tensor` flipped (the hub still names the true SHA-256);
    returns the true bytes."""
    true = hub.files[name]
    begin, end = _range_of(true, tensor)
    at = (begin + end) // 2
    hub.blobs[hub.lfs[name]] = true[:at] + bytes([true[at] ^ 0x01]) + true[at + 1 :]
    return true


def _mend(hub: StandIn, name: str = FIRST) -> None:
    hub.blobs[hub.lfs[name]] = hub.files[name]


def _range_of(data: bytes, tensor: str) -> tuple[int, int]:
    """Where `tensor`'s bytes begin and end in a safetensors file."""
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + n])[tensor]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _repo(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub" / "models--org--tiny"


def _nothing_kept(hub: StandIn, tmp_path: Path, name: str = FIRST) -> None:
    """Neither a blob nor a partial file nor a snapshot link of `name` is left: a later load downloads it anew."""
    _downloads_ended()
    blobs = _repo(tmp_path) / "blobs"
    sha = hub.lfs[name]
    assert not (blobs / sha).exists() and not (blobs / f"{sha}.incomplete").exists()
    link = _repo(tmp_path) / "snapshots" / COMMIT / name
    assert not link.exists() and not link.is_symlink()
    found = pytest.importorskip("huggingface_hub").try_to_load_from_cache(REPO, name, cache_dir=tmp_path / "hf" / "hub")
    assert not isinstance(found, str)  # huggingface_hub (and so transformers) finds nothing of it either


def _exact_once_mended(hub: StandIn, tmp_path: Path) -> None:
    """A load from the mended server equals safetensors' own reading of the true files, bit for bit."""
    _mend(hub)
    assert _same(streamload.load(REPO, device="cpu"), _original(tmp_path))
    _downloads_ended()
    blob = _repo(tmp_path) / "blobs" / hub.lfs[FIRST]
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == hub.lfs[FIRST]
    assert _same(load_file(_repo(tmp_path) / "snapshots" / COMMIT / FIRST), load_file(tmp_path / "original" / FIRST))


def _says_which(error: BaseException, name: str = FIRST) -> None:
    text = str(error)
    assert f"{REPO}@main" in text and name in text and "SHA-256" in text, text
    assert "\n" not in text


def test_load_refuses_a_file_whose_bytes_fail_the_hubs_sha256(hub: StandIn, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    _flip(hub)
    with pytest.raises(IntegrityError) as e:
        streamload.load(REPO, device="cpu")
    _says_which(e.value)
    assert e.value.handed_out == []  # `load` handed out nothing (its dict never reached the caller)
    _nothing_kept(hub, tmp_path)
    _online(monkeypatch, False)
    with pytest.raises(MissingFileError):  # offline, the cache has no copy of the file to take
        streamload.load(REPO, device="cpu")
    _online(monkeypatch, True)
    _exact_once_mended(hub, tmp_path)


def test_load_of_part_of_a_file_waits_for_its_verdict(hub: StandIn, tmp_path: Path) -> None:
    _flip(hub)  # tensor 11 is damaged; the load reads tensor 10 of the same file only
    with pytest.raises(IntegrityError) as e:
        streamload.load(REPO, device="cpu", include="model.layers.10.weight")
    _says_which(e.value)
    _nothing_kept(hub, tmp_path)
    _exact_once_mended(hub, tmp_path)


class _Tiny(nn.Module):
    """The stand-in's checkpoint as a module: `model.layers.<i>.weight`, 96 x 1024, for i in 10..13, 20..23."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        numbers = (*range(10, 14), *range(20, 24))
        self.model.layers = nn.ModuleDict({str(i): nn.Linear(1024, 96, bias=False) for i in numbers})


def test_load_into_refuses_a_file_whose_bytes_fail_the_hubs_sha256(hub: StandIn, tmp_path: Path) -> None:
    _flip(hub)
    with pytest.raises(IntegrityError) as e:
        streamload.load_into(_Tiny(), REPO, device="cpu")
    _says_which(e.value)
    _nothing_kept(hub, tmp_path)
    _mend(hub)
    module = _Tiny()
    streamload.load_into(module, REPO, device="cpu")
    assert _same(dict(module.state_dict()), _original(tmp_path))


def test_iter_fails_at_the_end_of_the_damaged_file_naming_it(hub: StandIn, tmp_path: Path) -> None:
    _flip(hub)
    rest = threading.Event()
    hub.held[hub.lfs[FIRST]] = (len(hub.files[FIRST]) * 3 // 4, rest)  # the CDN stalls before the file's end
    first = [f"model.layers.{i}.weight" for i in range(10, 14)]  # the damaged file's tensors, in file order
    got: list[str] = []
    with streamload.iter(REPO, device="cpu", order="file") as stream, pytest.raises(IntegrityError) as e:
        try:
            got.append(next(stream)[0])  # streamed: the file's first tensor comes before its verdict can
        finally:
            rest.set()
        for name, _ in stream:
            got.append(name)
    _says_which(e.value)
    assert got == first[: len(got)] and 1 <= len(got) < len(first)  # the file's last tensor never came out
    assert e.value.handed_out == got and e.value.path is not None and Path(str(e.value.path)).name == FIRST
    _nothing_kept(hub, tmp_path)
    _exact_once_mended(hub, tmp_path)


def test_iter_with_verify_hands_out_no_tensor_of_a_damaged_download(hub: StandIn, tmp_path: Path) -> None:
    _flip(hub)
    rest = threading.Event()
    hub.held[hub.lfs[FIRST]] = (len(hub.files[FIRST]) * 3 // 4, rest)  # still downloading as the stream starts
    release = threading.Timer(1.0, rest.set)
    got: list[str] = []
    try:
        release.start()
        with streamload.iter(REPO, device="cpu", verify=True) as stream, pytest.raises(IntegrityError) as e:
            for name, _ in stream:
                got.append(name)
    finally:
        rest.set()
        release.cancel()
        release.join()
    assert FIRST in str(e.value)
    assert not any(name.startswith("model.layers.1") for name in got), got  # none of the damaged file's
    _nothing_kept(hub, tmp_path)
    _mend(hub)
    assert _same(streamload.load(REPO, device="cpu", verify=True), _original(tmp_path))


def test_verify_holds_back_a_download_in_progress_until_its_file_passed(hub: StandIn, tmp_path: Path) -> None:
    rest = threading.Event()
    hub.held[hub.lfs[FIRST]] = (len(hub.files[FIRST]) // 2, rest)  # the CDN stalls half way through the file
    came = threading.Event()
    with streamload.iter(REPO, device="cpu", verify=True, order="file") as stream:

        def first() -> None:
            next(stream)
            came.set()

        taker = threading.Thread(target=first, daemon=True)
        try:
            taker.start()
            assert not came.wait(1.5)  # the first tensor's bytes are in, but not its file's verdict
        finally:
            rest.set()
            taker.join(30)
        assert came.is_set()
        got = dict(stream)
    assert len(got) == len(_original(tmp_path)) - 1


def test_a_resumed_partial_file_with_a_zeroed_tail_is_refused_and_downloaded_anew(hub: StandIn,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    true = hub.files[FIRST]
    kept = len(true) // 2
    blobs = _repo(tmp_path) / "blobs"
    blobs.mkdir(parents=True)
    partial = blobs / f"{hub.lfs[FIRST]}.incomplete"
    partial.write_bytes(true[: kept - 64 * 1024] + b"\0" * (64 * 1024))  # a crash left its last pages zeroed
    with pytest.raises(IntegrityError) as e:
        streamload.load(REPO, device="cpu")
    _says_which(e.value)
    assert any(r == f"bytes={kept}-" for server, _, r, _ in hub.requests if server == "cdn")  # it was resumed
    _nothing_kept(hub, tmp_path)  # the bad prefix went with the file
    hub.requests.clear()
    hub.sent = 0
    assert _same(streamload.load(REPO, device="cpu"), _original(tmp_path))
    assert hub.sent == len(true)  # downloaded from its first byte, nothing resumed
    assert all(r is None for server, path, r, _ in hub.requests if server == "cdn" and hub.lfs[FIRST] in path)


def test_from_pretrained_refuses_a_file_whose_bytes_fail_the_hubs_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub: StandIn
) -> None:
    transformers = pytest.importorskip("transformers")
    from .test_transformers import MODELS

    folder = tmp_path / "llama"
    MODELS["llama"]().save_pretrained(folder, max_shard_size="100KB")  # several shards and an index
    hub.files = {p.name: p.read_bytes() for p in folder.iterdir()}  # the stand-in serves this repo now
    hub.lfs = {n: hashlib.sha256(b).hexdigest() for n, b in hub.files.items() if n.endswith(".safetensors")}
    hub.blobs = {sha: hub.files[n] for n, sha in hub.lfs.items()}
    shard = sorted(hub.lfs)[0]
    tensor = max(load_file(folder / shard).items(), key=lambda item: item[1].nbytes)[0]
    _flip(hub, shard, tensor)
    with pytest.raises(IntegrityError) as e:
        streamload.from_pretrained(REPO, device="cpu")
    _says_which(e.value, shard)
    _nothing_kept(hub, tmp_path, shard)
    _mend(hub, shard)
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()  # nosec B615 # a local folder
    tokens = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(streamload.from_pretrained(REPO, device="cpu")(tokens).logits, reference(tokens).logits)


# -- the whole-file check itself ---------------------------------------------------------------------


def test_a_whole_file_check_passes_the_true_bytes_and_names_the_file_otherwise() -> None:
    from streamload.integrity.whole import WholeFile

    data = bytes(range(256)) * 100
    check = WholeFile("sha256", hashlib.sha256(data).hexdigest(), "org/x@main: a.safetensors", origin="the hub")
    for at in range(0, len(data), 1000):
        check.update(data[at : at + 1000])
    check.verdict()  # passes: no error
    assert check.hashed == len(data)
    bad = WholeFile("sha256", hashlib.sha256(data).hexdigest(), "org/x@main: a.safetensors", origin="the hub")
    bad.update(data[:-1] + b"\1")
    with pytest.raises(IntegrityError, match=r"^org/x@main: a\.safetensors: its SHA-256 is [0-9a-f]{64}, not "):
        bad.verdict()
    git = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    blob = WholeFile("sha1", git, "b.json", prefix=b"blob %d\0" % len(data))
    blob.update(data)
    blob.verdict()
    blob.reset()  # from the file's first byte again: the prefix is hashed anew
    blob.update(data)
    blob.verdict()
    with pytest.raises(ValueError, match="not a SHA-256"):
        WholeFile("sha256", "abc", "c")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a blob another user owns: needs root")
def test_a_blob_another_user_wrote_in_the_hub_cache_is_refused_not_hashed_against_its_own_name(
    hub: StandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A co-user of a hub cache can write `blobs/<SHA-256 of forged bytes>` and link the snapshot to it: the blob's
    name is what would check it, so such a copy is refused (naming it), online and offline, never read."""
    import huggingface_hub

    for name in hub.files:
        huggingface_hub.hf_hub_download(REPO, name, endpoint=hub.endpoint)
    blob = Path(huggingface_hub.try_to_load_from_cache(REPO, FIRST)).resolve()
    os.chown(blob, 65534, 65534)
    for online in (True, False):
        _online(monkeypatch, online)
        with pytest.raises(streamload.base.errors.SourceError, match="another user") as caught:
            streamload.load(REPO, device="cpu")
        assert str(blob.name) in str(caught.value)
    os.chown(blob, os.geteuid(), os.getegid())
    assert _same(streamload.load(REPO, device="cpu"), _original(tmp_path))
