"""Peer loading on real loopback servers: the store is tests/servers.py's RangeServer, the peers are
`streamload seed` servers (in this process, or a process of their own where one is killed) on other ports
of 127.0.0.1. Every load is compared bit for bit with safetensors' own."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.integrity.digests import DIGEST_FILE
from streamload.servers.seed import Seeder
from streamload.storage.peers import resolve, url_path, version_tag
from streamload.storage.remote import ObjectPath

from .conftest import same_bits
from .servers import RangeServer

pytest.importorskip("obstore")
pytest.importorskip("xxhash")


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "1")
    monkeypatch.setenv("STREAMLOAD_RETRIES", "2")
    monkeypatch.delenv("STREAMLOAD_PEERS_UNVERIFIED", raising=False)


def write_shards(folder: Path, seed: int, shape: tuple[int, int], per_shard: int) -> int:
    """Three shards with their index: `per_shard` tensors of `shape` each, a small bfloat16 one and one of zero
    bytes; their tensor bytes."""
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    index: dict[str, str] = {}
    total = 0
    for shard in range(3):
        state = {f"layers.{shard}.w{k}": torch.randn(*shape, generator=g) for k in range(per_shard)}
        state[f"layers.{shard}.b"] = torch.randn(7, generator=g).to(torch.bfloat16)
        state[f"layers.{shard}.empty"] = torch.empty(0)
        name = f"model-{shard + 1:05d}-of-00003.safetensors"
        save_file(state, folder / name)
        index.update(dict.fromkeys(state, name))
        total += sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return total


def _write(folder: Path, digests: bool) -> None:
    write_shards(folder, 1, (384, 512), 3)  # ~2.3 MB a shard, tensors of several digest blocks
    if digests:
        from streamload.pipeline.verify import write_digests

        write_digests(streamload.inspect(folder))


def publish_digests(url: str, folder: Path) -> None:
    """The digest file of the checkpoint at `url`, made by reading it from the store (so that each entry names
    the version of the object it was made from), published beside the objects."""
    from streamload.pipeline.verify import write_digests

    write_digests(streamload.inspect(url), out=folder / DIGEST_FILE)


def reference(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same(got: dict[str, torch.Tensor], folder: Path) -> None:
    ref = reference(folder)
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert same_bits(got[name], t), name


class Store:
    """The store: a RangeServer over `www` (a model with digests, one without), and a cache seeded from it."""

    def __init__(self, www: Path, seeded: Path) -> None:
        # 4 MB/s a response: a peer on the same host is faster, as one on a node's link is than a capped store
        self.server = RangeServer(www, rate=4e6)
        self.url = f"{self.server.url}/model/"
        self.bare = f"{self.server.url}/bare/"
        self.www, self.seeded = www, seeded
        publish_digests(self.url, www / "model")  # made from the store's objects: bound to their ETags
        streamload.load(self.url, device="cpu", cache_dir=seeded)
        streamload.load(self.bare, device="cpu", cache_dir=seeded)

    def copies(self, model: str = "model") -> list[Path]:
        host = self.server.url.split("://")[1].replace(":", "_")
        return sorted((self.seeded / "http" / host / model).glob("*.safetensors"))


def own_store(tmp_path: Path) -> Iterator[Store]:
    """A store of a test's own, over `tmp_path` (for tests that change its objects or its digest file)."""
    _write(tmp_path / "www" / "model", digests=False)
    _write(tmp_path / "www" / "bare", digests=False)
    store = Store(tmp_path / "www", tmp_path / "seeded")
    try:
        yield store
    finally:
        store.server.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    root = tmp_path_factory.mktemp("peers")
    _write(root / "www" / "model", digests=True)
    _write(root / "www" / "bare", digests=False)
    store = Store(root / "www", root / "seeded")
    yield store
    store.server.close()


@contextmanager
def seeders(cache: Path, n: int = 1, **options: object) -> Iterator[list[Seeder]]:
    started = [Seeder(cache, "127.0.0.1", 0, **options).start() for _ in range(n)]  # type: ignore[arg-type]
    try:
        yield started
    finally:
        for s in started:
            s.close()


def _asked(requests: list[tuple[str, str, str | None]]) -> dict[str, list[tuple[int, int]]]:
    """{file name: [(first byte, end)]} of the GETs with a Range among `requests`."""
    out: dict[str, list[tuple[int, int]]] = {}
    for method, path, wanted in requests:
        if method == "GET" and wanted and wanted.startswith("bytes="):
            a, b = wanted[6:].split("-")
            out.setdefault(path.rsplit("/", 1)[-1], []).append((int(a), int(b) + 1))
    return out


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether `spans` together cover bytes [start, end)."""
    at = start
    for a, b in sorted(spans):
        if a > at:
            return False
        at = max(at, b)
    return at >= end


def sent(store: Store) -> int:
    return store.server.sent


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- loading from peers ------------------------------------------------------------------------------
def test_three_peers_serve_everything_exactly(store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = sent(store)
    with seeders(store.seeded, 3) as peers:
        got = streamload.load(store.url, device="cpu", peers=[p.url for p in peers], cache_dir=tmp_path / "joiner")
        assert_same(got, store.www / "model")
        assert sent(store) == before  # the store served no tensor byte (headers, index, digests only)
        assert all(p.sent > 0 for p in peers), [p.sent for p in peers]  # spread across all three
    assert not warnings_of(caplog)
    # the late joiner's cache now holds complete copies: it can seed in turn
    with seeders(tmp_path / "joiner") as (joiner,):
        again = streamload.load(store.url, device="cpu", peers=joiner.url)
        assert_same(again, store.www / "model")
        assert sent(store) == before and joiner.sent > 0


def test_prefetch_fetch_and_a_name_whose_addresses_are_the_peers(store: Store, tmp_path: Path) -> None:
    from streamload.integrations.startup.prefetch import fetch

    before = sent(store)
    with seeders(store.seeded) as (peer,):
        port = peer.url.rsplit(":", 1)[1]
        assert "127.0.0.1" in [p.host for p in resolve(f"localhost:{port}")]
        report = fetch(store.url, tmp_path / "fetched", peers=f"localhost:{port}")  # its addresses are the peers
        assert report["ok"] and not report["not_cached"], report
        assert sent(store) == before and peer.sent > 0
    got = streamload.load(store.url, device="cpu", cache_dir=tmp_path / "fetched")
    assert_same(got, store.www / "model")


def test_what_no_peer_holds_comes_from_the_store(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _copy_cache(store, tmp_path / "some")
    for copy in cache.rglob("model/*.safetensors"):
        if "00002" not in copy.name:
            copy.unlink()  # this peer holds the second shard only
    shard = next(p for p in store.copies() if "00002" in p.name)
    other = next(p for p in store.copies() if "00002" not in p.name)
    first = len(store.server.requests)
    with seeders(cache) as (peer,):
        got = streamload.load(store.url, device="cpu", peers=peer.url)
    assert_same(got, store.www / "model")
    data = shard.stat().st_size - streamload.inspect(shard).files[0].data_start
    assert peer.sent == data  # every tensor byte of its shard, and nothing more
    asked = _asked(store.server.requests[first:])
    assert all(start == 0 for start, _ in asked.get(shard.name, [])), asked  # its header alone, from the store
    start = streamload.inspect(other).files[0].data_start
    assert _covered(asked[other.name], start, other.stat().st_size), asked  # the rest, every byte, from the store
    assert [w for w in warnings_of(caplog) if "does not hold" in w and peer.url in w]


def test_a_peer_killed_mid_load(store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seeder = subprocess.Popen(  # the command line, as a bench starts it
        [sys.executable, "-m", "streamload", "seed", "--cache-dir", str(store.seeded), "--host", "127.0.0.1",
         "--port", "0"], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert seeder.stdout is not None
        line = seeder.stdout.readline()
        url = next(w for w in line.split() if w.startswith("http://"))
        got = {}
        with streamload.iter(store.url, device="cpu", peers=[url], ring_bytes="2MiB", slots=2) as stream:
            for name, tensor in stream:
                if not got:
                    os.kill(seeder.pid, signal.SIGKILL)
                got[name] = tensor.clone()
        assert_same(got, store.www / "model")
    finally:
        seeder.kill()
        seeder.wait()
    dropped = [w for w in warnings_of(caplog) if url in w]  # asked after it was killed: dropped, said once
    assert len(dropped) == 1 and "failed" in dropped[0] and "dropped" in dropped[0], warnings_of(caplog)


def _vouch(copy: Path, **change: object) -> None:
    """The record of `copy` made to vouch for it as it is now (its inode and mtime), with `change`."""
    record = copy.parent / (copy.name + ".streamload.json")
    st = copy.stat()
    record.write_text(json.dumps({**json.loads(record.read_text()), "inode": st.st_ino, "mtime_ns": st.st_mtime_ns,
                                  **change}))  # fmt: skip


def _copy_cache(store: Store, into: Path, **change: object) -> Path:
    """A copy of the seeded cache that vouches for its copies (their records name the new inodes), with `change`."""
    shutil.copytree(store.seeded, into, symlinks=True, copy_function=shutil.copy2)
    for copy in into.rglob("*.safetensors"):
        _vouch(copy, **change)
    return into


def _flipped(store: Store, into: Path) -> Path:
    """A copy of the seeded cache with one byte of one tensor flipped, its record still vouching for it."""
    copy = next(p for p in _copy_cache(store, into).rglob("model/model-00002-of-00003.safetensors"))
    info = streamload.inspect(copy).tensors["layers.1.w1"]
    with open(copy, "r+b") as f:
        f.seek(info.begin + 300_000)
        byte = f.read(1)
        f.seek(info.begin + 300_000)
        f.write(bytes([byte[0] ^ 0x10]))
    _vouch(copy)
    return into


def test_a_peer_serving_a_flipped_byte(store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = _flipped(store, tmp_path / "bad")
    with seeders(bad) as (liar,):
        got = streamload.load(store.url, device="cpu", peers=[liar.url])
        assert_same(got, store.www / "model")
        named = [w for w in warnings_of(caplog) if liar.url in w]
        assert len(named) == 1 and "do not match the source's digests" in named[0], warnings_of(caplog)
        assert "layers.1.w1" in named[0] and len(warnings_of(caplog)) == 1


def test_no_digests_no_peers_unless_opted_in(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with seeders(store.seeded) as (peer,):
        got = streamload.load(store.bare, device="cpu", peers=peer.url)
        assert_same(got, store.www / "bare")
        assert peer.requests == []  # not even asked
        said = warnings_of(caplog)
        assert len(said) == 1 and "peers are not used for any file" in said[0], said
        assert "STREAMLOAD_PEERS_UNVERIFIED" in said[0] and "streamload digest" in said[0]
        monkeypatch.setenv("STREAMLOAD_PEERS_UNVERIFIED", "1")
        before = sent(store)
        got = streamload.load(store.bare, device="cpu", peers=peer.url)
        assert_same(got, store.www / "bare")
        assert sent(store) == before and peer.sent > 0


# -- bad peers -----------------------------------------------------------------------------------------
@contextmanager
def raw_server(answer: bytes | None) -> Iterator[str]:
    """A server on 127.0.0.1 that reads each request and sends `answer` (None: never answers), then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    held: list[socket.socket] = []

    def run() -> None:
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.settimeout(1)
                try:
                    conn.recv(65536)
                    conn.sendall(answer)
                except OSError:
                    pass
                conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        listener.close()
        thread.join()
        for conn in held:
            conn.close()


def test_bad_peers_each_a_warning_and_the_load_from_the_store(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refused = socket.create_server(("127.0.0.1", 0))
    down = f"http://127.0.0.1:{refused.getsockname()[1]}"
    refused.close()  # nothing listens there
    (tmp_path / "empty").mkdir()
    garbage = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\n\r\nabc"
    with (
        seeders(tmp_path / "empty") as (empty,),  # 404 for everything
        seeders(store.seeded, rate=200e3) as (trickle,),  # 200 kB/s: a MiB takes 5 s
        seeders(_copy_cache(store, tmp_path / "other", version='etag:"another"')) as (other,),  # 412
        raw_server(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n") as failing,
        raw_server(garbage) as liar,
        raw_server(b"this is not HTTP\r\n\r\n") as babbler,
        raw_server(None) as silent,
    ):
        given = ["not a url", "ftp://127.0.0.1:1", "nonexistent.invalid:8470", down, empty.url, other.url, failing,
                 liar, babbler, silent, trickle.url]  # fmt: skip
        before, began = sent(store), time.monotonic()
        got = streamload.load(store.url, device="cpu", peers=given, chunk_bytes="1MiB")
        took = time.monotonic() - began
    assert_same(got, store.www / "model")
    assert sent(store) > before  # the store served it
    assert took < 15, took  # bounded: the silent peer's second of timeout, not a hang
    said = warnings_of(caplog)
    for who, what in [("'not a url'", "is not a peer"), ("'ftp://127.0.0.1:1'", "is not a peer"),
                      ("nonexistent.invalid", "resolves to no address"), (down, "dropped"),
                      (empty.url, "does not hold"), (other.url, "holds another version"), (failing, "answered 500"),
                      (liar, "dropped"), (babbler, "dropped"), (silent, "did not answer within 1 s"),
                      (trickle.url, "dropped")]:  # fmt: skip
        mine = [w for w in said if who in w]
        assert len(mine) == 1 and what in mine[0], (who, said)


def test_peers_argument_types() -> None:
    with pytest.raises(TypeError, match="peers must be"):
        streamload.load("x.safetensors", peers=8470)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="peers must be URLs or host names"):
        streamload.load("x.safetensors", peers=["http://a:1", 2])  # type: ignore[list-item]


# -- what a seeder serves ------------------------------------------------------------------------------
def read_key_of(url: str) -> bytes:
    """The key a reader of the object at `url` (its origin) proves its requests to seeders with (no token)."""
    from streamload.storage.cache import version_of
    from streamload.storage.peer_proof import read_key

    header = streamload.inspect(url).files[0]
    return read_key(header.prefix, version_tag(version_of(header)), None)


def proved(key: bytes, method: str, path: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """`headers` with the proof of a request (storage/peer_proof.py) a seeder asks of every GET and HEAD."""
    from streamload.storage.peer_proof import HEADER, proof

    headers = dict(headers or {})
    return {**headers, HEADER: proof(key, method, path, headers.get("Range", ""))}


def _ask(
    url: str, path: str, headers: dict[str, str] | None = None, method: str = "GET", key: bytes | None = None
) -> tuple[int, dict, bytes]:
    host, port = url.split("://")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, headers=proved(key, method, path, headers) if key else headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_seeder_serves_ranges_of_vouched_copies(store: Store) -> None:
    copy = store.copies()[0]
    data = copy.read_bytes()
    source = ObjectPath(f"{store.url}{copy.name}")
    header = streamload.inspect(f"{store.url}{copy.name}").files[0]
    from streamload.storage.cache import version_of

    tag = version_tag(version_of(header))
    key = read_key_of(f"{store.url}{copy.name}")
    with seeders(store.seeded) as (seeder,):
        path = url_path(source)
        status, headers, body = _ask(seeder.url, path, {"Range": "bytes=100-1099"}, key=key)
        assert (status, body, headers["ETag"], headers["Content-Length"]) == (206, data[100:1100], tag, "1000")
        assert headers["Content-Range"] == f"bytes 100-1099/{len(data)}"
        assert _ask(seeder.url, path, {"Range": "bytes=-10"}, key=key)[2] == data[-10:]
        assert _ask(seeder.url, path, {"Range": f"bytes={len(data) - 5}-"}, key=key)[2] == data[-5:]
        status, headers, body = _ask(seeder.url, path, key=key)
        assert (status, body) == (200, data)
        status, headers, _ = _ask(seeder.url, path, {"Range": f"bytes={len(data)}-"}, key=key)
        assert (status, headers["Content-Range"]) == (416, f"bytes */{len(data)}")
        assert _ask(seeder.url, path, {"If-Match": tag, "Range": "bytes=0-0"}, key=key)[0] == 206
        assert _ask(seeder.url, path, {"If-Match": '"another"', "Range": "bytes=0-0"}, key=key)[0] == 412
        status, headers, body = _ask(seeder.url, path, method="HEAD", key=key)
        assert (status, headers["Content-Length"], body) == (200, str(len(data)), b"")


def test_seeder_refuses_partial_files_paths_outside_and_links(store: Store, tmp_path: Path) -> None:
    cache = _copy_cache(store, tmp_path / "cache")
    host = store.server.url.split("://")[1].replace(":", "_")
    folder = cache / "http" / host / "model"
    copy = sorted(folder.glob("*.safetensors"))[0]
    (tmp_path / "secret.safetensors").write_bytes(b"secret")
    partial = folder / f"{copy.name}.partial.host.1.abcd"  # a writer's file, whole bytes
    shutil.copy2(copy, partial)
    unrecorded = folder / "unrecorded.safetensors"  # a whole file the cache has no record of
    shutil.copy2(copy, unrecorded)
    linked = folder / "linked.safetensors"  # a link to a vouched copy, with a record that matches its target
    linked.symlink_to(copy)
    shutil.copy2(folder / f"{copy.name}.streamload.json", folder / "linked.safetensors.streamload.json")
    (cache / "http" / "alias").symlink_to(cache / "http" / host)  # a folder link to the real folder
    outside = folder / "outside.safetensors"
    outside.symlink_to(tmp_path / "secret.safetensors")
    base = f"/v1/http/{host}/model"
    key = read_key_of(f"{store.url}{copy.name}")
    with seeders(cache) as (seeder,):
        assert _ask(seeder.url, f"{base}/{copy.name}", {"Range": "bytes=0-9"}, key=key)[0] == 206  # the real one
        for path in [f"{base}/{partial.name}", f"{base}/unrecorded.safetensors", f"{base}/linked.safetensors",
                     f"/v1/http/alias/model/{copy.name}", f"{base}/outside.safetensors",
                     f"{base}/{copy.name}.streamload.json", f"{base}/../model/{copy.name}",
                     f"/v1/http/{host}/model%2F{copy.name}", f"/v1/http/{host}/..%2F..%2Fsecret.safetensors",
                     f"/v1/{tmp_path}/secret.safetensors", "/etc/passwd", f"/v1/http/{host}/model/"]:  # fmt: skip
            status, _, body = _ask(seeder.url, path, key=key)
            assert (status, body) == (404, b""), path
        assert seeder.sent == 10


def test_seeder_bounds_connections_and_rate(store: Store) -> None:
    copy = store.copies()[0]
    path = url_path(ObjectPath(f"{store.url}{copy.name}"))
    key = read_key_of(f"{store.url}{copy.name}")
    with seeders(store.seeded, connections=1, rate=2e6) as (seeder,):
        host, port = seeder.url.split("://")[1].rsplit(":", 1)
        held = http.client.HTTPConnection(host, int(port), timeout=5)
        held.request("HEAD", path, headers=proved(key, "HEAD", path))
        assert held.getresponse().status == 200  # kept open: the one connection there is (idle < EVICT_AFTER)
        assert _ask(seeder.url, path, {"Range": "bytes=0-9"}, key=key)[0] == 503
        held.close()
        time.sleep(0.2)
        began = time.monotonic()
        status, _, body = _ask(seeder.url, path, {"Range": "bytes=0-999999"}, key=key)
        assert (status, len(body)) == (206, 1_000_000) and time.monotonic() - began > 0.4  # 2 MB/s
