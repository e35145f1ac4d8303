"""Seeding: the complete copies a cache directory holds, served to peers over HTTP ranges.

    streamload seed --cache-dir DIR [--host H] [--port P] [--rate 50MB] [--connections N]
    python -m streamload seed ...          (the same; prints the URL it serves at, then serves until stopped)

`GET /v1/<scheme>/<host>/<key>` (and HEAD) answers with the copy of the object `scheme://host/key` that
`DIR/<scheme>/<host>/<key>` holds (the cache's layout, storage/cache.py; the URL scheme is peers.py's), with
`Range: bytes=a-b` (206, `Content-Range`; 416 past the end), `Content-Length`, and a strong `ETag` made of
the version the copy's record names (`peers.version_tag`: the same on every node holding that version, so a
peer asks with `If-Match` and gets 412 for another version). Only what the cache vouches for is served:
a copy whose record names its inode, modification time and size (a partial file, a record, a lock, a copy
being written, anything else: 404). Each folder is opened from the one above it without following a link
and the copy with `O_NOFOLLOW` (storage/cache.py's `Folders`): a link planted in the cache, or a path that
leaves it (`..`, an encoded `/`), is 404. Files are opened read-only; nothing is ever written.

Bounded: at most `connections` connections at once (one more is answered 503 and closed), an idle
connection closed after `IDLE` seconds, and `rate` (bytes a second, all connections together) caps what
seeding takes of the node's link. The server's threads are daemons: it stops with its process.

No authentication: whoever reaches the port can read the cached weights. Bind an address peers share
(`--host`), and keep the port inside the cluster's network (a NetworkPolicy, a firewall).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from ..atomic import PARTIAL
from .cache import LOCK, RECORD, Folders, Place, record_of
from .peers import DEFAULT_PORT, PREFIX, version_tag

log = logging.getLogger("streamload")
CONNECTIONS = 32  # connections served at once (default)
IDLE = 30.0  # seconds a kept connection may wait for its next request
_PACED = 256 << 10  # bytes sent at a time under a rate cap
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _Pace:
    """A rate cap shared by every connection: each send takes its slot in time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until `n` more bytes are within the rate (the end of their slot: no burst ahead of it)."""
        with self._lock:
            now = time.monotonic()
            self._next = max(now, self._next) + n / self.rate
            until = self._next
        time.sleep(max(0.0, until - now))


class Seeder:
    """Serves the complete copies in `cache_dir` (see the module's docstring). `start` serves on a daemon
    thread; `close` stops. `url`: where it serves (the port chosen where `port=0`)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        host: str = "0.0.0.0",  # nosec B104 # seeding is for other nodes; the module's docstring says what to bind
        port: int = DEFAULT_PORT,
        rate: float | None = None,
        connections: int = CONNECTIONS,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.pace = _Pace(rate) if rate else None
        self.connections = connections
        self.open = 0
        self.sent = 0  # body bytes sent
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._lock = threading.Lock()
        self.httpd = _server(self, host, port)
        bound = self.httpd.server_address
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
        self.url = f"http://{shown}:{bound[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> Seeder:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="streamload-seed", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Seeder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def copy(self, url_path: str) -> tuple[int, os.stat_result, dict[str, object]] | None:
        """The open copy (descriptor, its stat, its record) that a request's path names, if the cache vouches
        for it; else None. Never through a link, never outside the cache, never a partial file."""
        names = _names(url_path)
        if names is None:
            return None
        folders = Folders(self.cache_dir, create=False)
        fd = None
        try:  # the record is read through the folder's descriptor too: closed only after
            place = Place(folders.folder(tuple(names[:-1])), names[-1], self.cache_dir.joinpath(*names))
            if place.linked() is not None:
                return None
            fd = place.open("", os.O_RDONLY)
            st = os.fstat(fd)
            record = record_of(place, st) if stat.S_ISREG(st.st_mode) else None
        except OSError:
            record = None
        finally:
            folders.close()
        if record is None:
            if fd is not None:
                os.close(fd)
            return None
        return fd, st, record


def _names(url_path: str) -> list[str] | None:
    """The cache's names a request's path stands for (`<scheme>/<host>/<key...>`), or None where it names
    no copy: outside `/v1/`, an empty, `.` or `..` part, an encoded `/` or NUL, a record, lock or partial file."""
    path = urlsplit(url_path).path
    if not path.startswith(PREFIX):
        return None
    try:
        names = [unquote(n, errors="strict") for n in path[len(PREFIX) :].split("/")]
    except UnicodeDecodeError:
        return None
    if len(names) < 3 or any(n in ("", ".", "..") or "/" in n or "\0" in n for n in names):
        return None
    last = names[-1]
    if last.endswith((RECORD, LOCK)) or PARTIAL in last:
        return None
    return names


def _server(seeder: Seeder, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(_Handler):
        pass

    Handler.seeder = seeder

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True
        request_queue_size = 128

        def server_bind(self) -> None:  # HTTPServer's asks the resolver for the host's name: not needed
            TCPServer.server_bind(self)
            self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            with seeder._lock:
                seeder.open += 1
            try:
                super().process_request_thread(request, client_address)
            finally:
                with seeder._lock:
                    seeder.open -= 1

    return Server((host, port), Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE  # a kept connection's wait for its next request (and each send's)
    seeder: Seeder

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("streamload seed: %s: " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        seeder = self.seeder
        if seeder.open > seeder.connections:
            self.close_connection = True
            self._status(503, {"Retry-After": "1", "Connection": "close"})
            return
        found = seeder.copy(self.path)
        if found is None:
            self._status(404)
            return
        fd, st, record = found
        try:
            self._send(fd, st.st_size, version_tag(record), body)
        finally:
            os.close(fd)

    def _send(self, fd: int, size: int, tag: str, body: bool) -> None:
        match = self.headers.get("If-Match")
        if match is not None and match.strip() != "*" and tag not in [m.strip() for m in match.split(",")]:
            self._status(412, {"ETag": tag})
            return
        span = _span(self.headers.get("Range"), size)
        if span == "unsatisfiable":
            self._status(416, {"Content-Range": f"bytes */{size}", "ETag": tag})
            return
        start, end = span if isinstance(span, tuple) else (0, size)
        self._record(206 if isinstance(span, tuple) else 200)
        self.send_response(206 if isinstance(span, tuple) else 200)
        self.send_header("ETag", tag)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if isinstance(span, tuple):
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body and end > start:
            self._body(fd, start, end)

    def _body(self, fd: int, start: int, end: int) -> None:
        pace = self.seeder.pace
        step = _PACED if pace is not None else end - start
        try:
            with open(fd, "rb", closefd=False) as f:
                at = start
                while at < end:
                    n = min(step, end - at)
                    if pace is not None:
                        pace.take(n)
                    sent = self.connection.sendfile(f, at, n)
                    with self.seeder._lock:
                        self.seeder.sent += sent
                    if sent < n:  # the file was cut short since its record was written: the answer is cut
                        self.close_connection = True
                        return
                    at += n
        except OSError:  # the peer went (a reset, a broken pipe, a timeout)
            self.close_connection = True

    def _status(self, code: int, headers: dict[str, str] | None = None) -> None:
        self._record(code)
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _record(self, status: int) -> None:
        with self.seeder._lock:
            self.seeder.requests.append((self.command, self.path, status))
            del self.seeder.requests[:-1000]


def _span(header: str | None, size: int) -> tuple[int, int] | str | None:
    """[start, end) a Range header asks for; "unsatisfiable" (416); None to answer whole (no Range, or
    one this server ignores, as RFC 9110 allows: several ranges, another unit, bad syntax)."""
    match = _RANGE.fullmatch((header or "").strip())
    if match is None or not (match[1] or match[2]):
        return None
    if not match[1]:  # the last N bytes
        n = int(match[2])
        return (max(0, size - n), size) if n and size else "unsatisfiable"
    start = int(match[1])
    if match[2] and int(match[2]) < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(size, int(match[2]) + 1) if match[2] else size


def address(text: str) -> tuple[str, int]:
    """(host, port) of `[HOST:]PORT` (`--seed 8470`, `--seed 10.0.0.5:8470`, `--seed [::1]:0`); the host
    all addresses where none is given. Raises ValueError naming the text."""
    host, _, port = str(text).strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or int(port) > 65535 or (host and not re.fullmatch(r"[A-Za-z0-9_.:-]+", host)):
        raise ValueError(f"{text!r} is not [HOST:]PORT (e.g. 8470, 10.0.0.5:8470, [::1]:8470)")
    return host or "0.0.0.0", int(port)  # nosec B104 # seeding is for other nodes (see Seeder)


def serve(
    cache_dir: str | os.PathLike[str],
    host: str = "0.0.0.0",  # nosec B104 # see Seeder
    port: int | None = None,
    rate: float | None = None,
    connections: int = CONNECTIONS,
) -> None:
    """`streamload seed`: serve until SIGTERM or SIGINT; the first line printed names the URL."""
    seeder = Seeder(cache_dir, host, DEFAULT_PORT if port is None else port, rate, connections)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    seeder.start()
    limit = f", at most {rate / 1e6:g} MB/s" if rate else ""
    print(f"streamload seed: serving the complete copies in {cache_dir} at {seeder.url} (at most {connections} "
          f"connections{limit}; no authentication: whoever reaches the port reads them)", flush=True)  # fmt: skip
    try:
        while not stop.wait(1.0):
            pass
    finally:
        seeder.close()


__all__ = ["CONNECTIONS", "Seeder", "address", "serve"]
