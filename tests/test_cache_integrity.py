"""A shared cache's copies pass the integrity layer: another user's copy is used only where the origin's digest
file (bound to the version) checks it, every block before its tensor is handed out; else it is not read."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamload
from streamload.base.errors import IntegrityError
from streamload.integrity.digests import DIGEST_FILE
from streamload.storage import cache as cache_module

from .test_peers import Store, _vouch, assert_same, own_store, warnings_of
from .test_peers import quick as quick  # the autouse fixture, found here too

SHARD = "model-00002-of-00003.safetensors"
OTHER_USER = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes copies another user owns: needs root")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A store of this test's own, its digest file published (made from the store's objects)."""
    yield from own_store(tmp_path)


def another_users(cache: Path, change: bool) -> Path:
    """The copy of SHARD in `cache` made another user's (as if that user's load had written it), with one
    tensor's bytes changed where `change`, its record still vouching for it."""
    copy = next(cache.rglob(f"model/{SHARD}"))
    if change:
        info = streamload.inspect(copy).tensors["layers.1.w1"]
        with open(copy, "r+b") as f:
            f.seek(info.begin + 4096)
            f.write(b"\x7f" * 16)
        _vouch(copy)
    for p in (copy, Path(f"{copy}{cache_module.RECORD}")):
        os.chown(p, OTHER_USER, OTHER_USER)
    return copy


def test_another_users_copy_without_digests_is_not_read(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    (store.www / "model" / DIGEST_FILE).unlink()
    copy = another_users(store.seeded, change=True)
    before = store.server.sent
    got = streamload.load(store.url, device="cpu", cache_dir=store.seeded)
    assert_same(got, store.www / "model")
    assert store.server.sent - before > copy.stat().st_size / 2  # from the origin
    said = warnings_of(caplog)
    assert len(said) == 1 and "another user" in said[0] and str(copy) in said[0], said


def test_another_users_changed_copy_fails_its_origin_digests(store: Store) -> None:
    copy = another_users(store.seeded, change=True)
    with pytest.raises(IntegrityError, match="layers.1.w1") as caught:
        streamload.load(store.url, device="cpu", cache_dir=store.seeded)
    assert str(copy) in str(caught.value)


def test_another_users_intact_copy_is_checked_and_used(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    another_users(store.seeded, change=False)
    before = store.server.data_requests()
    with caplog.at_level(logging.WARNING, "streamload"):
        got = streamload.load(store.url, device="cpu", cache_dir=store.seeded)
    assert_same(got, store.www / "model")
    assert store.server.data_requests() == before and not warnings_of(caplog)


def test_a_pinned_digest_is_checked_on_another_users_copy(store: Store) -> None:
    """The caller's own `verify={file: sha256}` is never replaced by the copy's block digests."""
    another_users(store.seeded, change=False)
    with pytest.raises(IntegrityError, match=SHARD):
        streamload.load(store.url, device="cpu", cache_dir=store.seeded, verify={SHARD: "0" * 64})


def test_a_seeder_serves_no_copy_another_user_wrote(store: Store) -> None:
    """A seeder vouches only for what its own user's loads kept (each checked, or read from the origin)."""
    from .test_peers import seeders

    another_users(store.seeded, change=False)
    with seeders(store.seeded) as (seeder,):
        got = streamload.load(store.url, device="cpu", peers=[seeder.url])
        assert_same(got, store.www / "model")
        asked = [status for method, path, status in seeder.requests if SHARD in path]
        assert asked and all(status == 404 for status in asked), seeder.requests
