"""A seeder (servers/seed.py) under hostile clients and a hostile cache: what one costs it is bounded (threads,
connection slots, the time a request's headers, an idle connection and a response may take), and it serves
only regular files with one link that the cache's records vouch for; the cache's own reads (storage/cache.py)
neither block on a FIFO nor trust a hard-linked copy. All on 127.0.0.1."""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

import streamload
from streamload.servers import seed
from streamload.storage.cache import Copies, lookup
from streamload.storage.peer_proof import HEADER, proof, read_key
from streamload.storage.peers import version_tag

from .test_seed_auth import Cached, ask, cached, seeding

__all__ = ["cached"]  # the module's fixture, shared: one cache a load filled

pytest.importorskip("obstore")


def _cache_copy(cached: Cached, into: Path) -> tuple[Path, Path]:
    """A copy of the cache whose record vouches for the new copy; (the cache, the copy in it)."""
    shutil.copytree(cached.cache, into, symlinks=True)
    copy = into / cached.copy.relative_to(cached.cache)
    _forge(copy)
    return into, copy


def _forge(at: Path, **change: object) -> dict[str, object]:
    """A record beside `at` vouching for whatever is there now (its inode, modification time and size)."""
    st = os.stat(at, follow_symlinks=False)
    record = {"size": st.st_size, "version": 'etag:"forged"', "inode": st.st_ino, "mtime_ns": st.st_mtime_ns, **change}
    at.with_name(at.name + ".streamload.json").write_text(json.dumps(record))
    return record


def _raw(url: str) -> socket.socket:
    host, port = url.split("://")[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_within(conn: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `conn` (whatever it sent first is read and dropped); None if not by then."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        ready, _, _ = select.select([conn], [], [], 0.1)
        if ready:
            try:
                if not conn.recv(65536):
                    return time.monotonic() - began
            except OSError:
                return time.monotonic() - began
    return None


@contextmanager
def _unblocked(fifo: Path) -> Iterator[None]:
    """On the way out, a reader blocked opening `fifo` (the unchanged code's) is let go: opened for writing."""
    try:
        yield
    finally:
        with suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# -- connections -----------------------------------------------------------------------------------------
def test_300_idle_sockets_take_no_thread_each_and_an_honest_peer_is_served(cached: Cached) -> None:
    before = threading.active_count()
    held: list[socket.socket] = []
    with seeding(cached.cache, connections=4, header_timeout=2.0) as seeder:
        try:
            host, port = seeder.url.split("://")[1].rsplit(":", 1)
            for _ in range(300):
                with suppress(OSError):
                    held.append(socket.create_connection((host, int(port)), timeout=5))
            time.sleep(0.5)  # a server with a thread per connection has started them all by now
            threads = threading.active_count() - before
            assert threads <= 12, f"{threads} threads for 300 idle connections"
            began = time.monotonic()
            status, got, body = ask(seeder.url, cached.path, cached.key(), {"Range": "bytes=0-65535"})
            if status == 503:  # every slot held (until the header deadline, or a new connection's need)
                assert got.get("Retry-After") == "1" and got.get("Connection") == "close"
                time.sleep(2.5)
                status, got, body = ask(seeder.url, cached.path, cached.key(), {"Range": "bytes=0-65535"})
            assert (status, body) == (206, cached.data[:65536])
            assert time.monotonic() - began < 10
            assert threading.active_count() - before <= 12
        finally:
            for conn in held:
                conn.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before  # closed: none of its threads left


def test_over_the_cap_a_canned_503_at_accept(cached: Cached, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seed, "EVICT_AFTER", 60.0)  # however slow this machine, the silent one keeps its slot
    with seeding(cached.cache, connections=1, header_timeout=30.0) as seeder:
        first = _raw(seeder.url)  # holds the one slot (silent)
        try:
            second = _raw(seeder.url)  # sends nothing: the answer comes anyway, unread
            try:
                second.settimeout(5)
                answer = second.recv(4096)
                assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1\r\n" in answer, answer
                assert b"Connection: close\r\n" in answer
                assert _closed_within(second, 5) is not None
            finally:
                second.close()
        finally:
            first.close()


def test_a_header_drip_is_cut_at_the_header_deadline(cached: Cached) -> None:
    request = f"GET {cached.path} HTTP/1.1\r\nHost: x\r\n" + "X-Pad: y\r\n" * 20
    with seeding(cached.cache, header_timeout=2.0) as seeder:
        conn = _raw(seeder.url)
        try:
            began = time.monotonic()
            cut = None
            for byte in request.encode():  # a byte a second: each well within any per-receive timeout
                try:
                    conn.send(bytes([byte]))
                except OSError:
                    cut = time.monotonic() - began
                    break
                if _closed_within(conn, 1.0) is not None:
                    cut = time.monotonic() - began
                    break
                if time.monotonic() - began > 15:
                    break
            assert cut is not None and cut < 8, f"still open after {time.monotonic() - began:.0f} s"
            assert seeder.open == 0
        finally:
            conn.close()


def test_an_idle_kept_connection_is_closed_after_idle(cached: Cached) -> None:
    with seeding(cached.cache, idle=1.0) as seeder:
        conn = _raw(seeder.url)
        try:
            span = "bytes=0-9"
            conn.sendall(f"GET {cached.path} HTTP/1.1\r\nHost: x\r\nRange: {span}\r\n"
                         f"{HEADER}: {proof(cached.key(), 'GET', cached.path, span)}\r\n\r\n".encode())  # fmt: skip
            conn.settimeout(5)
            answer = b""
            while not answer.endswith(cached.data[:10]):
                chunk = conn.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 206 ")
            took = _closed_within(conn, 10)
            assert took is not None and took < 6, took
        finally:
            conn.close()


def test_at_the_cap_an_idle_kept_connection_makes_room(cached: Cached, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seed, "EVICT_AFTER", 0.2)
    with seeding(cached.cache, connections=1) as seeder:
        kept = _raw(seeder.url)
        try:
            kept.sendall(f"HEAD {cached.path} HTTP/1.1\r\nHost: x\r\n"
                         f"{HEADER}: {proof(cached.key(), 'HEAD', cached.path)}\r\n\r\n".encode())  # fmt: skip
            kept.settimeout(5)
            assert kept.recv(4096).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.5)  # idle now, kept open (a peer's pooled connection)
            status, _, body = ask(seeder.url, cached.path, cached.key(), {"Range": "bytes=0-9"})
            assert (status, body) == (206, cached.data[:10])
            assert _closed_within(kept, 5) is not None  # the one that made room
        finally:
            kept.close()


def test_a_peer_that_stops_reading_loses_its_connection(cached: Cached, tmp_path: Path) -> None:
    """The send deadline: the size at a floor rate plus a margin (both made small here)."""
    cache, copy = _cache_copy(cached, tmp_path / "cache")
    header = b'{"__metadata__":{"x":"y"}}'
    with open(copy, "wb") as f:  # 64 MB: more than every socket buffer between the two ends
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(64 << 20)
    record = _forge(copy)
    key = read_key(len(header).to_bytes(8, "little") + header, version_tag(record), None)
    with seeding(cache, send_floor=1e9, send_margin=1.0) as seeder:
        conn = _raw(seeder.url)
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.sendall(f"GET {cached.path} HTTP/1.1\r\nHost: x\r\n"
                         f"{HEADER}: {proof(key, 'GET', cached.path)}\r\n\r\n".encode())  # fmt: skip
            deadline = time.monotonic() + 15
            while not seeder.requests and time.monotonic() < deadline:  # answering
                time.sleep(0.05)
            assert seeder.requests == [("GET", cached.path, 200)]
            while seeder.open and time.monotonic() < deadline:  # never read: the seeder gives up on it
                time.sleep(0.1)
            assert seeder.open == 0
            assert seeder.sent < 64 << 20
        finally:
            conn.close()


# -- what is served --------------------------------------------------------------------------------------
def test_a_fifo_in_the_cache_is_404_at_once_and_a_load_through_it_does_not_hang(cached: Cached, tmp_path: Path) -> None:
    cache, copy = _cache_copy(cached, tmp_path / "cache")
    copy.unlink()
    os.mkfifo(copy)
    _forge(copy)  # vouching for the FIFO (its size: 0)
    with _unblocked(copy), seeding(cache) as seeder:
        began = time.monotonic()
        try:
            status, _, _ = ask(seeder.url, cached.path, cached.key(), timeout=10)
        except TimeoutError:
            status = None
        assert status == 404 and time.monotonic() - began < 8, status
    _forge(copy, size=cached.header.size)  # now naming the object's size too
    with _unblocked(copy):
        done: list[object] = []

        def through_copies() -> None:
            copies = Copies(cache, {cached.header.path: cached.header}, ())
            try:
                done.append(copies.local(cached.header.path))
            finally:
                copies.close()

        thread = threading.Thread(target=through_copies, daemon=True)
        thread.start()
        thread.join(15)
        assert not thread.is_alive(), "Copies blocked opening a FIFO"
        assert done == [None]  # no copy to read: the load reads the store (and writes a copy of its own)
        assert lookup(cache, [cached.header]) is None
    assert stat.S_ISFIFO(os.stat(copy).st_mode)


def test_a_hard_link_with_a_forged_record_is_404_and_no_copy(cached: Cached, tmp_path: Path) -> None:
    cache, copy = _cache_copy(cached, tmp_path / "cache")
    secret = tmp_path / "secret.safetensors"  # a file of this user's, outside the cache
    shutil.copy2(copy, secret)
    linked = copy.with_name("linked.safetensors")
    os.link(secret, linked)
    record = _forge(linked)
    key = read_key(cached.header.prefix, version_tag(record), None)  # a proof as good as one can be
    path = cached.path.rsplit("/", 1)[0] + "/linked.safetensors"
    with seeding(cache) as seeder:
        status, _, body = ask(seeder.url, path, key, {"Range": "bytes=0-99"})
        assert (status, body) == (404, b"")
        assert ask(seeder.url, cached.path, cached.key(), {"Range": "bytes=0-9"})[0] == 403  # forged version
        assert seeder.sent == 0
    original = json.loads(cached.copy.with_name(cached.copy.name + ".streamload.json").read_text())
    _forge(copy, version=original["version"])
    assert lookup(cache, [cached.header]) is not None  # one link: the load's copy
    os.link(copy, tmp_path / "elsewhere.safetensors")
    assert lookup(cache, [cached.header]) is None  # two: whoever holds the other name can change it


def test_a_5000_digit_range_is_answered(cached: Cached, capfd: pytest.CaptureFixture[str]) -> None:
    huge = "9" * 5000
    with seeding(cached.cache) as seeder:
        for span in (f"bytes={huge}-", f"bytes=0-{huge}", f"bytes=-{huge}", f"bytes={huge}-{huge}"):
            try:
                status, _, body = ask(seeder.url, cached.path, cached.key(), {"Range": span})
            except OSError as exc:  # the connection dropped: no answer
                pytest.fail(f"{span[:20]}...: {exc!r}")
            assert status in (200, 206, 416), status
            assert body in (b"", cached.data), len(body)
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_larger_than_the_header_limit_is_refused(cached: Cached) -> None:
    with seeding(cached.cache) as seeder:
        conn = _raw(seeder.url)
        try:
            with suppress(OSError):
                conn.sendall(f"GET {cached.path} HTTP/1.1\r\n".encode() + b"X-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
            conn.settimeout(5)
            try:
                answer = conn.recv(4096)
            except OSError as exc:
                assert exc.errno in (errno.ECONNRESET, errno.EPIPE)
                answer = b""
            assert not answer or answer.startswith((b"HTTP/1.1 4",)), answer[:40]
            assert _closed_within(conn, 5) is not None
        finally:
            conn.close()


def test_a_load_still_reads_its_own_copy(cached: Cached) -> None:
    """The checks refuse the hostile, not the cache's own copies (one link, a regular file)."""
    assert lookup(cached.cache, [cached.header]) == [cached.copy]
    got = streamload.load(cached.copy, device="cpu")
    assert set(got) == {"w", "b"}
