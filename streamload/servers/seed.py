"""Seeding: the complete copies a cache directory holds, and what a load of this process has verified of the
copies it is still writing there, served to peers over HTTP ranges (`streamload seed`; docs/peers.md tells users).

`GET /v1/<scheme>/<host>/<key>` (and HEAD) answers with the copy of `scheme://host/key` that
`DIR/<scheme>/<host>/<key>` holds (the cache's layout, storage/cache.py), with `Range: bytes=a-b` (206; 416 past
the end; a number too long to be an offset is one past any end) and a strong `ETag` made of the version the
copy's record names (`peers.version_tag`): a peer asks with `If-Match` and gets 412 for another version, before
its proof is checked, as a proof is made for one version (a 412 names no version).

Only what the cache vouches for is served: this user's regular file with one link (a FIFO, a device, a hard
link to a file elsewhere is 404), opened without blocking and read-only, whose record names its inode,
modification time and size (a partial file, a record, a lock, anything else: 404). Each folder is opened from
the one above it without following a link, the copy and its record with `O_NOFOLLOW` (storage/cache.py): a
planted link, or a path that leaves the cache (`..`, an encoded `/`), is 404. Nothing is ever written. Where
there is no complete copy but a load of this process writes one at that place (storage/verified.py, found by
the folder and name, never by a path), the writer's own file is served, only within the ranges that load
verified: a range not yet verified is waited for (at most the request's `X-Streamload-Wait`, and
`LONG_POLL`), then 404. Every answer names the node (`X-Streamload-Node`); a copy's, whether it is
complete or loading (`X-Streamload-Copy`).

Who may read: every request carries `X-Streamload-Proof` (storage/peer_proof.py), keyed by the copy's header
bytes, its version tag and the peers' token. Without one, with one made with another key (a co-tenant who
never read the object from its origin, or lacks the token), for another request, or seen before: 403 and the
connection closed, not a byte. With `--cert`/`--key` it serves TLS; without, the bytes cross the network in the
clear.

Bounded, whatever the peers do: one thread runs every connection (asyncio; HTTP/1.1 parsed by h11; bodies by
sendfile over plain TCP) and `IO_THREADS` open the cache's files, so a connection costs no thread. Past
`connections`, one more is answered at accept with a canned 503 and closed unread, unless one that has waited
`EVICT_AFTER` s for a request can be closed to make room. A request's headers (at most `HEAD_LIMIT` bytes) must
arrive within `header_timeout` s; a kept connection waits `idle` s for its next request; a response must go
within its size at `send_floor` bytes a second plus `send_margin` s. `rate` caps all connections together.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import signal
import socket
import ssl
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

import h11

from streamload.base.atomic import PARTIAL
from streamload.format.header import HEADER_LIMIT
from streamload.storage import verified
from streamload.storage.cache import LOCK, RECORD, Folders, Place, open_copy, own, record_of, single, version_of
from streamload.storage.local import pread_full
from streamload.storage.peer_proof import HEADER, Proofs, read_key, token
from streamload.storage.peers import DEFAULT_PORT, PREFIX, version_tag
from streamload.storage.verified import CLAIMED, COPY, LONG_POLL, NODE, WAIT, Verified

log = logging.getLogger("streamload")
CONNECTIONS = 32  # connections served at once (default)
IDLE = 30.0  # seconds a kept connection may wait for its next request
HEADERS = 10.0  # seconds a request's line and headers may take, whole
EVICT_AFTER = 2.0  # seconds a connection must have waited for a request before a new one may take its place
SEND_FLOOR = 256 << 10  # bytes a second a response is given at least (its deadline: its size at this rate)
SEND_MARGIN = 30.0  # seconds a response is given on top
IO_THREADS = 4  # threads opening copies and reading their headers (a slow disk holds these, not the server)
HEAD_LIMIT = 16 << 10  # bytes of a request's line and headers
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_PACED = 256 << 10  # bytes sent at a time under a rate cap
_SEALED = 1 << 20  # bytes read at a time for a TLS connection
_READ = 64 << 10  # bytes read from a connection at a time
_KEYS = 256  # read keys remembered (by file and version: a header is read once, not once a request)
_DIGITS = 19  # digits of a Range number read as they are; a longer one is past any end
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_PROOF = HEADER.lower().encode()
_WAIT = WAIT.lower().encode()


class _Conn:
    """One admitted connection: its task, since when it has waited for a request (None while one arrives
    or is answered), and the deadline that ends it (its task cancelled)."""

    __slots__ = ("_timer", "kept", "task", "waiting")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.waiting: float | None = time.monotonic()
        self.kept = False  # has answered a request: waits `idle` for the next
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, seconds: float) -> None:
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self.end)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self) -> None:
        if self.task is not None:
            self.task.cancel()


class Seeder:
    """Serves the complete copies in `cache_dir`, and what this process's loads verified of the copies they
    write there (see the module's docstring). `start` serves on a daemon thread; `close` stops. `url`: where
    it serves (the port chosen where `port=0`; https:// with `cert`); `node`: the id its answers name.
    `token_file`: the peers' token (default: the environment's, peer_proof.token); `cert`, `key`: PEM files
    to serve TLS with. Raises ValueError naming a cache directory it could serve nothing from (missing, a
    file, one this user cannot list or enter), a port out of range, or a token, certificate or key file that
    cannot be used, and OSError where the address cannot be bound."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        host: str = "0.0.0.0",  # nosec B104 # seeding is for other nodes; the module's docstring says what to bind
        port: int = DEFAULT_PORT,
        rate: float | None = None,
        connections: int = CONNECTIONS,
        *,
        token_file: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        header_timeout: float = HEADERS,
        idle: float = IDLE,
        send_floor: float = SEND_FLOOR,
        send_margin: float = SEND_MARGIN,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        # Said now: a seeder that could open no copy would print its URL and answer 404 for ever.
        if not self.cache_dir.exists():
            raise ValueError(f"{self.cache_dir}: no such folder: nothing to seed (give the cache_dir loads keep "
                             "their copies in)")  # fmt: skip
        if not self.cache_dir.is_dir():
            raise ValueError(f"{self.cache_dir}: not a folder: seeding serves a cache directory's copies")
        if not os.access(self.cache_dir, os.R_OK | os.X_OK):  # every copy is opened from it (storage/cache.py)
            raise ValueError(f"{self.cache_dir}: cannot read this folder (list and enter it): nothing could be served")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port {port!r} is out of range: a port is 0..65535 (0: any free one)")
        self.rate = rate
        self._paced_until = 0.0  # under `rate`, every connection's sends take their slots in turn (monotonic)
        self.connections = connections
        self.header_timeout, self.idle, self.send_margin = header_timeout, idle, send_margin
        self.send_floor = min(send_floor, rate / connections / 2) if rate else send_floor  # a paced share is slower
        self.sent = 0  # body bytes sent
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._secret = token(token_file)
        self.node = verified.node_id(self.cache_dir)  # named in every answer: a load finds itself among its peers
        self._tls = _tls(cert, key)
        self._proofs = Proofs()
        self._keys: OrderedDict[tuple[object, ...], bytes] = OrderedDict()
        self._keys_lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._refusals: set[asyncio.Task[None]] = set()  # TLS connections being told 503 (at most `connections`)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        bound = self._listener.getsockname()
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
        self.url = f"{'https' if self._tls else 'http'}://{shown}:{bound[1]}"
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def open(self) -> int:
        """Connections open now (being served or waiting for a request)."""
        return len(self._conns)

    def start(self) -> Seeder:
        with self._lock:
            if self._thread is not None or self._closed:
                return self
            self._listener.setblocking(False)
            self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="streamload-seed-io")
            self._loop = loop = asyncio.new_event_loop()
            loop.set_default_executor(self._pool)  # asyncio's own file reads (sendfile over TLS) go there too
            self._main = loop.create_task(self._serve())
            self._thread = threading.Thread(target=self._run, name="streamload-seed", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop: every connection closed, the threads ended, the port let go."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None and self._loop is not None and self._main is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._listener.close()

    def __enter__(self) -> Seeder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the server's thread -------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None and self._main is not None
        try:
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._main)
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        warned = -1e9
        try:
            while True:
                try:
                    sock, _ = await loop.sock_accept(self._listener)
                except OSError as exc:  # out of descriptors, a connection reset before it was taken
                    if exc.errno not in (errno.ECONNABORTED, errno.EPROTO):
                        now = time.monotonic()
                        if now - warned > 60:  # a minute's failures, one line
                            warned = now
                            log.warning("streamload seed: %s: cannot accept a connection: %s", self.url, exc)
                        await asyncio.sleep(0.1)
                    continue
                self._admit(sock)
        finally:
            tasks = [c.task for c in self._conns if c.task is not None] + list(self._refusals)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _admit(self, sock: socket.socket) -> None:
        """Serve `sock`, or refuse it at once where every slot is held (making room where one can be had): the
        canned 503, written without reading (no task, no thread); over TLS, after the handshake (at most
        `connections` at once: beyond, closed)."""
        loop = asyncio.get_running_loop()
        conn = _Conn()
        if len(self._conns) < self.connections or self._make_room():
            self._conns.add(conn)
            conn.task = loop.create_task(self._connection(conn, sock))
        elif self._tls is not None and len(self._refusals) < self.connections:
            conn.task = loop.create_task(self._connection(conn, sock, refuse=True))
            self._refusals.add(conn.task)
            conn.task.add_done_callback(self._refusals.discard)
        else:
            if self._tls is None:
                with contextlib.suppress(OSError):
                    sock.send(BUSY)
            sock.close()

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request, if one has waited `EVICT_AFTER`."""
        now = time.monotonic()
        waiting = [c for c in self._conns if c.waiting is not None and now - c.waiting >= EVICT_AFTER]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.waiting or now)
        self._conns.discard(oldest)
        oldest.end()
        return True

    async def _connection(self, conn: _Conn, sock: socket.socket, refuse: bool = False) -> None:
        """Serve `sock` until it ends, or (`refuse`) tell it 503 once its TLS handshake is done."""
        loop = asyncio.get_running_loop()
        conn.arm(self.header_timeout)  # the handshake and the first request's headers
        transport: asyncio.Transport | None = None
        peer = "a peer"
        try:
            peer = str(sock.getpeername()[0])
            reader = asyncio.StreamReader()
            protocol = asyncio.StreamReaderProtocol(reader)
            tls = {"ssl": self._tls, "ssl_handshake_timeout": self.header_timeout} if self._tls else {}
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock, **tls)  # type: ignore[arg-type]
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            http = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
            if refuse:
                writer.write(BUSY)  # its request never read
            while not refuse and await self._exchange(conn, reader, writer, http, peer):
                http.start_next_cycle()
                conn.kept, conn.waiting = True, time.monotonic()
                conn.arm(self.idle)
            writer.close()  # what was written goes first (within the deadline armed last); `abort` drops it
            await writer.wait_closed()
        except asyncio.CancelledError:
            pass  # a deadline, room made for another, or the seeder closing
        except (OSError, EOFError, ssl.SSLError, h11.ProtocolError):
            pass  # the peer went, or broke TLS or HTTP
        except Exception as exc:  # one line, never a traceback: a bug here costs a connection, not the server
            log.warning("streamload seed: %s: %s: %s", peer, type(exc).__name__, exc)
        finally:
            conn.disarm()
            self._conns.discard(conn)
            if transport is not None:
                transport.abort()  # (closed already: a no-op)
            sock.close()  # (where the transport has it, closed already: a no-op)

    async def _exchange(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, http: h11.Connection, peer: str
    ) -> bool:
        """One request answered; whether the connection may carry another."""
        request = await self._request(conn, reader, writer, http)
        if request is None:
            return False
        conn.arm(self.header_timeout)  # finding the copy and its key
        method, target = request.method.decode("latin-1"), request.target.decode("latin-1")
        fields: dict[bytes, list[str]] = {}  # each name's values, in order
        for name, value in request.headers:  # (h11 gives the names lower-case)
            fields.setdefault(name, []).append(value.decode("latin-1"))
        if method not in ("GET", "HEAD"):
            return await self._canned(writer, 405, method, target, {"Allow": "GET, HEAD"})
        if not _ended(http) or len(fields.get(b"range", ())) > 1:
            return await self._canned(writer, 400, method, target)  # a body, or two ranges: no peer sends either
        proofs, span = fields.get(_PROOF, []), (fields.get(b"range") or [""])[0]
        match = (fields.get(b"if-match") or ["*"])[0]  # checked before the proof: it is made for one version
        tags = [] if match.strip() == "*" else [m.strip() for m in match.split(",")]
        found = await self._found(target, tags)
        if found is None:
            return await self._respond(writer, http, method, target, 404)
        try:
            if tags and found.tag not in tags:
                return await self._respond(writer, http, method, target, 412)  # (its tag not said)
            value = proofs[0] if len(proofs) == 1 else None  # none, or two: no proof
            why = self._proofs.check(found.key, value, method, target, span)
            if why is not None:  # said to the log; to the peer, no more than 403
                log.info("streamload seed: %s: 403 for %s %s: %s", peer, method, target, why)
                return await self._canned(writer, 403, method, target)
            return await self._answer(conn, writer, http, method, target, found, span, fields.get(_WAIT, ["0"])[0])
        finally:
            os.close(found.fd)

    async def _answer(
        self, conn: _Conn, writer: asyncio.StreamWriter, http: h11.Connection, method: str, target: str, found: _Found,
        span: str, wait: str,
    ) -> bool:  # fmt: skip
        """The answer to a request whose proof was accepted: its range of the copy. From a copy in progress,
        only bytes its load verified: a range not yet verified is waited for (at most the `X-Streamload-Wait`
        the request gives, and `LONG_POLL`), else 404."""
        size, tag = found.size, found.tag
        asked = _span(span, size)
        if asked == "unsatisfiable":
            unsatisfiable = {"Content-Range": f"bytes */{size}", "ETag": tag}
            return await self._respond(writer, http, method, target, 416, unsatisfiable)
        headers = {"ETag": tag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        loading = found.loading
        headers[COPY] = "complete" if loading is None else f"loading; since={loading.since:.3f}"
        if loading is not None and method == "HEAD":
            headers[CLAIMED] = loading.claimed()
        start, end, status = 0, size, 200
        if isinstance(asked, tuple):
            (start, end), status = asked, 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if loading is not None and method == "GET":
            if not await _verified(loading, start, end, min(_seconds(wait), LONG_POLL)):
                return await self._respond(writer, http, method, target, 404)  # never a byte not verified
        conn.arm(self.send_margin + (end - start) / self.send_floor)  # the response's whole send
        body = (found.fd, start, end) if method == "GET" else None
        return await self._respond(writer, http, method, target, status, headers, end - start, body)

    async def _request(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, http: h11.Connection
    ) -> h11.Request | None:
        """The next request's line and headers, within their deadline; None where the connection ends
        (closed by the peer, or answered 400/431 for what is not HTTP/1.1)."""
        while True:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError as exc:
                await self._canned(writer, exc.error_status_hint, "", "")
                return None
            if event is h11.NEED_DATA:
                data = await reader.read(_READ)
                if data and conn.waiting is not None:  # a request's first byte: its headers' deadline
                    conn.waiting = None
                    if conn.kept:
                        conn.arm(self.header_timeout)
                http.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                conn.waiting = None
                return event
            return None  # ConnectionClosed

    async def _found(self, target: str, tags: list[str]) -> _Found | None:
        """The copy `target` names, open, with its size, version tag and read key (on the I/O threads: a
        slow disk holds them, not the server); its descriptor closed where this request is gone by then."""
        assert self._pool is not None
        future = self._pool.submit(self._look_up, target, tags)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_found)
            raise

    def _look_up(self, url_path: str, tags: list[str]) -> _Found | None:
        """The open copy that a request's path names, if the cache vouches for it, or else the copy a load of
        this process writes there (of the version `tags` name, where they name one); else None. Never through
        a link, never outside the cache, never another's partial file, never anything but a regular file with
        one link (a FIFO never blocks: `cache.open_copy`), never one without a safetensors header (no copy a
        peer could have asked for)."""
        names = _names(url_path)
        if names is None:
            return None
        folders = Folders(self.cache_dir, create=False)
        try:  # the record is read through the folder's descriptor too: closed only after
            folder = folders.folder(tuple(names[:-1]))
            place = Place(folder, names[-1], self.cache_dir.joinpath(*names))
            found = self._complete(place)
            if found is None or (tags and found.tag not in tags):
                loading = self._loading(folder, names[-1])
                if loading is not None and (found is None or loading.tag in tags):
                    if found is not None:
                        os.close(found.fd)
                    found = loading
                elif found is None:  # its load may have completed it between the two looks: complete now
                    found = self._complete(place)
            return found
        except (OSError, KeyError, TypeError, ValueError):
            return None
        finally:
            folders.close()

    def _complete(self, place: Place) -> _Found | None:
        """The complete copy at `place`, open, if its record vouches for it and it is this user's."""
        fd = key = None
        try:
            fd = open_copy(place)  # (the copy and its record are opened without following a link)
            st = os.fstat(fd)
            record = record_of(place, st)
            if record is not None and own(place, st):  # another user's copy was never checked by our loads
                tag = version_tag(record)
                key = self._read_key((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, tag), fd, st.st_size, tag)
        except (OSError, KeyError, TypeError, ValueError):
            key = None
        if key is None:
            if fd is not None:
                os.close(fd)
            return None
        return _Found(fd, st.st_size, tag, key, None)

    def _loading(self, folder: int, name: str) -> _Found | None:
        """The copy a load of this process writes as `name` in `folder`, open (its writer's own file: this
        user's, one link), with the key of the version whose header that load read from the origin."""
        loading = verified.loading(folder, name)
        fd = None if loading is None else loading.open()
        if loading is None or fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not single(st) or st.st_uid != os.geteuid():  # a link made to it since: no longer its own file
                raise OSError(errno.EINVAL, "not a regular file with one link")
            tag = version_tag(version_of(loading.header))
            key = self._read_key(("loading", st.st_dev, st.st_ino, tag), fd, st.st_size, tag, loading.header.prefix)
        except BaseException:
            os.close(fd)
            raise
        if key is None:
            os.close(fd)
            return None
        return _Found(fd, loading.header.size, tag, key, loading)

    def _read_key(
        self, known: tuple[object, ...], fd: int, size: int, tag: str, prefix: bytes | None = None
    ) -> bytes | None:
        """The key proofs for this copy's version are made with (peer_proof.read_key), remembered by file
        (`known`); made from `prefix` (the header bytes a load read from the origin), else the copy's own."""
        with self._keys_lock:
            key = self._keys.get(known)
            if key is not None:
                self._keys.move_to_end(known)
                return key
        prefix = prefix if prefix is not None else _header_prefix(fd, size)
        if prefix is None:
            return None
        key = read_key(prefix, tag, self._secret)
        with self._keys_lock:
            self._keys[known] = key
            while len(self._keys) > _KEYS:
                self._keys.popitem(last=False)
        return key

    async def _body(self, writer: asyncio.StreamWriter, fd: int, start: int, end: int) -> bool:
        """Bytes [start, end) of the copy, by sendfile where the connection is plain TCP (else read on the I/O
        threads, `_SEALED` at a time, and encrypted); whether all went (a file cut short since its record was
        written cuts the answer: the connection is closed)."""
        loop = asyncio.get_running_loop()
        await writer.drain()
        step = _PACED if self.rate else end - start if self._tls is None else _SEALED
        with open(fd, "rb", closefd=False) as f:
            at = start
            while at < end:
                n = min(step, end - at)
                if self.rate:  # until the end of these bytes' slot: no burst ahead of it
                    now = time.monotonic()
                    self._paced_until = max(now, self._paced_until) + n / self.rate
                    await asyncio.sleep(self._paced_until - now)
                if self._tls is None:
                    try:
                        sent = await loop.sendfile(writer.transport, f, at, n)
                    except RuntimeError:  # "Transport is closing": the peer went
                        return False
                else:  # asyncio's own fallback reads 16 KiB at a time: ten times slower
                    data = await loop.run_in_executor(None, os.pread, fd, n, at)
                    writer.write(data)
                    await writer.drain()
                    sent = len(data)
                self.sent += sent
                if sent < n:
                    return False
                at += n
        return True

    async def _respond(
        self, writer: asyncio.StreamWriter, http: h11.Connection, method: str, target: str, status: int,
        headers: dict[str, str] | None = None, length: int = 0, body: tuple[int, int, int] | None = None,
    ) -> bool:  # fmt: skip
        """A response of `length` bytes, its body (a GET's) bytes [start, end) of the copy `body` names (fd, start,
        end); whether the connection may carry another request."""
        self._record(method, target, status)
        fields = [*(headers or {}).items(), (NODE, self.node), ("Content-Length", str(length))]
        writer.write(http.send(h11.Response(status_code=status, headers=fields, reason=HTTPStatus(status).phrase)))
        if body is not None and length:
            # h11 counts the body's length (a range stands for it); `_body` sends its bytes
            http.send_with_data_passthrough(h11.Data(data=range(length)))  # type: ignore[arg-type]
            if not await self._body(writer, *body):
                return False
        writer.write(http.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        return http.our_state is h11.DONE and http.their_state is h11.DONE

    async def _canned(
        self, writer: asyncio.StreamWriter, status: int, method: str, target: str, headers: dict[str, str] | None = None
    ) -> bool:
        """A response without a body, then the connection closed (written whatever state h11 is in)."""
        if method:
            self._record(method, target, status)
        more = "".join(f"{k}: {v}\r\n" for k, v in {**(headers or {}), NODE: self.node}.items())
        writer.write(f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n{more}Connection: close\r\n"
                     "Content-Length: 0\r\n\r\n".encode())  # fmt: skip
        await writer.drain()
        return False

    def _record(self, method: str, target: str, status: int) -> None:
        self.requests.append((method, target, status))
        del self.requests[:-1000]


class _Found(NamedTuple):
    """A copy a request names, open: its size, version tag, read key, and what its load verified of it
    (None: a complete copy)."""

    fd: int
    size: int
    tag: str
    key: bytes
    loading: Verified | None


def _close_found(future: Future[_Found | None]) -> None:
    """The descriptor a lookup opened for a request that went while it ran, closed."""
    if not future.cancelled() and future.exception() is None and (found := future.result()) is not None:
        os.close(found.fd)


async def _verified(loading: Verified, start: int, end: int, wait: float) -> bool:
    """Whether bytes [start, end) of a copy in progress are verified, waiting for them at most `wait` s (told
    of each change by its load; the node's fetcher told that a peer waits for them)."""
    if loading.covers(start, end):
        return True
    if wait <= 0:
        return False
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def tell() -> None:
        with contextlib.suppress(RuntimeError):  # the loop has ended (the seeder closed)
            loop.call_soon_threadsafe(changed.set)

    deadline = loop.time() + wait
    loading.listen(tell)
    loading.want(start, end)
    try:
        while not loading.covers(start, end) and not loading.ended:
            changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), deadline - loop.time())
            if loop.time() >= deadline:
                break
        return loading.covers(start, end)
    finally:
        loading.want(start, end, add=False)
        loading.listen(tell, add=False)


def _seconds(text: str) -> float:
    """A request's `X-Streamload-Wait` in seconds (0 where it is not a number)."""
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if 0 < value < 3600 else 0.0


def _ended(http: h11.Connection) -> bool:
    """Whether the request just received has ended with its headers (a GET or HEAD has no body)."""
    try:
        return isinstance(http.next_event(), h11.EndOfMessage)
    except h11.RemoteProtocolError:
        return False


def _tls(cert: str | os.PathLike[str] | None, key: str | os.PathLike[str] | None) -> ssl.SSLContext | None:
    """A TLS server context with the certificate (chain) and key in these PEM files; None without `cert`.
    Raises ValueError naming the files where they cannot be used."""
    if cert is None:
        if key is not None:
            raise ValueError(f"{key}: a TLS key without its certificate (give the certificate too)")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        files = f"{cert} and {key}" if key is not None else str(cert)
        raise ValueError(f"{files}: cannot serve TLS with this certificate and key: {exc.strerror or exc}") from None
    return context


def _header_prefix(fd: int, size: int) -> bytes | None:
    """The copy's length word and JSON header as a load reads them from the origin (N capped as safetensors
    caps it); None where the file has none."""
    word = bytes(pread_full(fd, 8, 0))
    n = int.from_bytes(word, "little")
    if len(word) < 8 or n > HEADER_LIMIT or 8 + n > size:
        return None
    rest = pread_full(fd, n, 8)
    return word + rest if len(rest) == n else None


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


def _number(digits: str) -> int:
    """A Range number; one too long to be read (a 5000-digit one) is past any end, as its value is."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= _DIGITS else 1 << 64


def _span(header: str | None, size: int) -> tuple[int, int] | str | None:
    """[start, end) a Range header asks for; "unsatisfiable" (416); None to answer whole (no Range, or
    one this server ignores, as RFC 9110 allows: several ranges, another unit, bad syntax)."""
    match = _RANGE.fullmatch((header or "").strip())
    if match is None or not (match[1] or match[2]):
        return None
    if not match[1]:  # the last N bytes
        n = _number(match[2])
        return (max(0, size - n), size) if n and size else "unsatisfiable"
    start = _number(match[1])
    if match[2] and _number(match[2]) < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(size, _number(match[2]) + 1) if match[2] else size


def address(text: str) -> tuple[str, int]:
    """(host, port) of `[HOST:]PORT` (`--seed 8470`, `--seed 10.0.0.5:8470`, `--seed [::1]:0`); the host
    all addresses where none is given. Raises ValueError naming the text."""
    host, _, port = str(text).strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or int(port) > 65535 or (host and not re.fullmatch(r"[A-Za-z0-9_.:-]+", host)):
        raise ValueError(f"{text!r} is not [HOST:]PORT (e.g. 8470, 10.0.0.5:8470, [::1]:8470)")
    return host or "0.0.0.0", int(port)  # nosec B104 # seeding is for other nodes (see Seeder)


def described(seeder: Seeder) -> str:
    """Who may read what `seeder` serves, and what the path sees, in a few words (the printed lines')."""
    who = "peers that read each object from its origin" + (" and hold the peers' token" if seeder._secret else "")
    path = "TLS" if seeder._tls else "plain HTTP: the bytes are visible on the path"
    return f"{who}; {path}"


def serve(
    cache_dir: str | os.PathLike[str],
    host: str = "0.0.0.0",  # nosec B104 # see Seeder
    port: int | None = None,
    rate: float | None = None,
    connections: int = CONNECTIONS,
    **files: str | os.PathLike[str] | None,
) -> None:
    """`streamload seed`: serve until SIGTERM or SIGINT; the first line printed names the URL. `files`: the
    token file, certificate and key (Seeder's)."""
    seeder = Seeder(cache_dir, host, DEFAULT_PORT if port is None else port, rate, connections, **files)  # type: ignore[arg-type]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    seeder.start()
    limit = f", at most {rate / 1e6:g} MB/s" if rate else ""
    print(f"streamload seed: serving the complete copies in {cache_dir} at {seeder.url} (at most {connections} "
          f"connections{limit}; to {described(seeder)})", flush=True)  # fmt: skip
    try:
        while not stop.wait(1.0):
            pass
    finally:
        seeder.close()


__all__ = ["CONNECTIONS", "Seeder", "address", "described", "serve"]
