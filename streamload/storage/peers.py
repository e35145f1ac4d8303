"""Peers: a remote checkpoint's bytes from nodes that hold complete copies of its files, over plain HTTP
ranges (`streamload seed`, storage/seed.py), each block checked against the source's digests before use;
the source (the object store) serves what no peer has, and everything a peer fails at.

`peers=` (of `iter`, `load`, `prefetch.fetch`, vLLM's options): peer URLs (`http://host:port`, or
`host[:port]`, port 8470 by default), a list of them or one text with commas; each name's addresses are
peers (`socket.getaddrinfo`): a Kubernetes headless service's name is every pod behind it.

Protocol (plain HTTP/1.1, nothing home-made): the file that the source URL `scheme://host/key` names is
`GET /v1/<scheme>/<host>/<key>` on a peer, the cache's own layout under `cache_dir` (storage/cache.py: a
host's `:` written `_`; each part percent-encoded), with `Range: bytes=a-b` and `If-Match: <tag>`, where
the tag is a strong ETag made of the version the source's header named (size, and ETag or Last-Modified:
`version_tag`). A peer that holds a complete copy of that version answers 206 with that ETag; another
version 412; no copy 404.

A load (`PeerFiles`) reads each range of a file the peers hold from the peer with the fewest requests in
flight (at most `REQUESTS` each), whole digest blocks at a time, so that every block is checked against the
source's digest file (`streamload digest`, beside the weights: per-tensor xxh3-64 blocks) before a byte of
it is used. Which peers hold a file is asked once a load, when it is first read (HEAD, all peers at once).
A block failing its digest is read from the source. A peer that fails (down, a timeout, a reset, an answer
that is not the range asked for, a block failing its digest, slower than the source) is dropped for the
rest of the load, with one warning naming it; a peer without the file (404) or with another version (412)
is not asked for that file (one warning a peer). Requests to peers are bounded: `STREAMLOAD_PEER_TIMEOUT`
seconds (default 5) to connect and between bytes, and a whole request gets that plus a second per MB.

Files the source publishes no digests of are read from the source alone (one warning saying why), unless
`STREAMLOAD_PEERS_UNVERIFIED=1`: then a peer's bytes of them are used as it sends them (versions still
matched by the tag; a peer sending wrong bytes gives wrong tensors).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import socket
import statistics
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePath
from typing import Any, NamedTuple
from urllib.parse import quote, urlsplit

from ..errors import IntegrityError
from ..format import FileHeader
from .base import Digest, Listing, Partly, Source, redacted
from .cache import cache_path, version_of
from .digests import DIGEST_FILE, block_digest, entry_of, parse
from .remote import ObjectFiles, ObjectPath, ObjectStorage

log = logging.getLogger("streamload")

DEFAULT_PORT = 8470
PREFIX = "/v1/"
UNVERIFIED = "STREAMLOAD_PEERS_UNVERIFIED"
TIMEOUT = "STREAMLOAD_PEER_TIMEOUT"
REQUESTS = 4  # requests in flight to one peer at once, per load
PIECE = 8 << 20  # the most one request to a peer asks for (whole blocks)
UNCHECKED_BLOCK = 1 << 20  # the pieces of a file without digests (STREAMLOAD_PEERS_UNVERIFIED=1)
MEASURED = 1 << 20  # requests this large tell a peer's rate
SLOW_AFTER = 3  # measured requests before a peer's rate is judged against the source's
FLOOR_RATE = 1e6  # bytes a second a request gets on top of the timeout before it is given up
Peers = str | Sequence[str]
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def url_path(path: PurePath) -> str:
    """The URL path a peer serves the object at `path` (an ObjectPath) under: its place in a cache."""
    return PREFIX + "/".join(quote(name, safe="") for name in cache_path(Path(), path).parts)


def version_tag(version: Mapping[str, object]) -> str:
    """The strong ETag of one version of an object (a cache record's size and version): equal on every node
    that holds that version, whatever its cache directory."""
    named = json.dumps({"size": version["size"], "version": version["version"]}, sort_keys=True)
    return '"' + hashlib.sha256(named.encode()).hexdigest()[:40] + '"'


def timeout() -> float:
    """Seconds a peer may take to connect, or between bytes (`STREAMLOAD_PEER_TIMEOUT`)."""
    try:
        return max(0.05, float(os.environ.get(TIMEOUT, "5")))
    except ValueError:
        return 5.0


def unverified_allowed() -> bool:
    return os.environ.get(UNVERIFIED, "").strip().lower() in ("1", "true", "yes")


# -- who the peers are ---------------------------------------------------------------------------------
class Peer(NamedTuple):
    """One peer: an address to connect to, and how messages name it."""

    name: str
    host: str  # an address (IPv6 without brackets)
    port: int
    base: str  # a path the peer's URLs start with ("" for none)


def names(peers: Peers | None) -> list[str]:
    """The entries of `peers=`: a list, or text with commas between them."""
    if peers is None:
        return []
    entries = peers.split(",") if isinstance(peers, str) else list(peers)
    return [e.strip() for e in entries if isinstance(e, str) and e.strip()]


def _parsed(entry: str) -> tuple[str, int, str] | None:
    """(host, port, base path) of a peer's URL or `host[:port]`; None where it is neither."""
    if "://" in entry and not entry.startswith("http://"):
        return None  # https: peers are reached by address, which a certificate does not name
    try:
        parts = urlsplit(entry if "://" in entry else f"http://{entry}")
        port = parts.port or DEFAULT_PORT
    except ValueError:
        return None
    host = parts.netloc.rsplit(":", 1)[0] if parts.port else parts.netloc
    if not host or not _HOST.fullmatch(host) or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    return (parts.hostname or host), port, parts.path.rstrip("/")


def resolve(peers: Peers | None) -> list[Peer]:
    """The peers `peers=` names: each entry's name resolved to its addresses, each address a peer (once).
    An entry that is not a peer's URL, or a name that resolves to nothing, is left out with a warning."""
    out: list[Peer] = []
    seen: set[tuple[str, int, str]] = set()
    for entry in names(peers):
        parsed = _parsed(entry)
        if parsed is None:
            log.warning("streamload: peers: %r is not a peer (http://host:port, host:port, or a name whose "
                        "addresses are the peers): left out", redacted(entry))  # fmt: skip
            continue
        host, port, base = parsed
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            log.warning("streamload: peers: %s resolves to no address (%s): left out", host, exc)
            continue
        for *_, address in found:
            ip = str(address[0])
            if (ip, port, base) in seen:
                continue
            seen.add((ip, port, base))
            shown = f"http://{f'[{ip}]' if ':' in ip else ip}:{port}{base}"
            out.append(Peer(shown if ip == host else f"{shown} ({host})", ip, port, base))
    return out


# -- what a file's blocks are --------------------------------------------------------------------------
class Unit(NamedTuple):
    """A range of a file that is fetched and checked whole: a digest block of one tensor."""

    start: int
    end: int
    digest: str | None  # None: unchecked (STREAMLOAD_PEERS_UNVERIFIED=1)
    what: str  # how a message names it


class Units:
    """The checked units of one file, in file order (a tensor's blocks, then the next tensor's)."""

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.ends = [u.end for u in units]

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """[lo, hi) cut into (start, end, i, j): units i..j-1 (contiguous, at most `PIECE` bytes together)
        where i < j, or bytes no unit covers (i == j: read from the source)."""
        out: list[tuple[int, int, int, int]] = []
        units, i, pos = self.units, bisect_right(self.ends, lo), lo
        while pos < hi:
            if i < len(units) and units[i].start <= pos:
                j = i + 1
                while (j < len(units) and units[j].start == units[j - 1].end and units[j - 1].end < hi
                       and units[j].end - units[i].start <= PIECE):  # fmt: skip
                    j += 1
                out.append((units[i].start, units[j - 1].end, i, j))
                pos, i = units[j - 1].end, j
            else:
                nxt = min(hi, units[i].start if i < len(units) else hi)
                out.append((pos, nxt, i, i))
                pos = nxt
        return out


def file_units(header: FileHeader, doc: Mapping[str, Any] | None, where: str) -> tuple[Units | None, str]:
    """The checked units of one file from the source's digest file (`doc`), or (None, why not)."""
    entry, stale = entry_of(doc, header.path.name, header.size, where)
    if stale is not None:
        return None, stale
    if entry is None:
        if unverified_allowed():
            step = UNCHECKED_BLOCK
            return Units([Unit(a, min(a + step, header.size), None, f"bytes {a}..") for a in
                          range(header.data_start, header.size, step)]), ""  # fmt: skip
        return None, f"no digests of it ({where} {'has no entry for it' if doc else 'is absent'})"
    head = entry.get("header_sha256")
    if head is not None and len(header.prefix) == header.data_start:
        if hashlib.sha256(header.prefix).hexdigest() != head:
            return None, f"{where} was made for another version of it (its header differs)"
    block, blocks = int(entry.get("block_bytes", (doc or {}).get("block_bytes", 1 << 20))), entry.get("tensors")
    units: list[Unit] = []
    for info in sorted(header.tensors, key=lambda t: t.begin):
        mine = blocks.get(info.name) if isinstance(blocks, dict) else None
        count = -(-info.nbytes // block)
        if not isinstance(mine, list) or len(mine) != count:
            return None, f"{where} has no digests of tensor {info.name!r} (or the wrong number)"
        for k in range(count):
            lo = info.begin + k * block
            units.append(Unit(lo, min(lo + block, info.end), str(mine[k]), f"tensor {info.name!r} block {k + 1}"))
    return Units(units), ""


# -- the storage ---------------------------------------------------------------------------------------
def with_peers(storage: Any, peers: Peers | None) -> Any:
    """`storage` reading from `peers` first where it is an object storage (s3://, http(s)://); else
    `storage` itself (a local file, a cache's complete copy, a hub id: said once at INFO)."""
    if not names(peers):
        return storage
    if not isinstance(storage, ObjectStorage):
        log.info("streamload: peers are asked for the files of s3:// and http(s):// sources; this one is read "
                 "from %s storage", getattr(storage, "kind", "its"))  # fmt: skip
        return storage
    return PeerStorage(storage, peers)


class PeerStorage:
    """An object storage whose loads read the ranges peers hold from them (see the module's docstring);
    everything else is the object storage's."""

    def __init__(self, inner: ObjectStorage, peers: Peers) -> None:
        self.inner, self.peers = inner, peers
        self.kind, self.first_batch = inner.kind, inner.first_batch
        self.root, self.cache_dir = inner.root, inner.cache_dir

    def locate(self, source: Source) -> Listing:
        return self.inner.locate(source)

    def header(self, path: PurePath) -> FileHeader:
        return self.inner.header(path)

    def cached(self, headers: tuple[FileHeader, ...]) -> list[Path] | None:
        return self.inner.cached(headers)

    def digest(self, header: FileHeader) -> Digest | None:
        return self.inner.digest(header)

    def sidecar(self, near: PurePath, name: str) -> bytes | None:
        return self.inner.sidecar(near, name)

    def open(self, headers: dict[PurePath, FileHeader], partly: Partly = None) -> ObjectFiles:
        units = self._units(headers)
        peers = resolve(self.peers) if units else []
        if not peers:
            if units:
                log.info("streamload: peers: none of %s names a peer: this load reads from the source",
                         ", ".join(names(self.peers)))  # fmt: skip
            return self.inner.open(headers, partly)

        def files(storage: ObjectStorage, headers: dict[PurePath, FileHeader], partly: Partly) -> ObjectFiles:
            return PeerFiles(storage, headers, partly, Swarm(peers, headers), units)

        return self.inner.open(headers, partly, files)

    def _units(self, headers: dict[PurePath, FileHeader]) -> dict[PurePath, Units]:
        """The units peers may serve, by file; what the source publishes no digests of is said once."""
        docs: dict[PurePath, dict[str, Any] | None] = {}
        out: dict[PurePath, Units] = {}
        without: list[str] = []
        for path, header in headers.items():
            folder = path.parent
            where = f"{folder}/{DIGEST_FILE}"
            if folder not in docs:
                raw = self.inner.sidecar(path, DIGEST_FILE)
                try:
                    docs[folder] = None if raw is None else parse(raw, where)
                except IntegrityError as exc:
                    log.warning("streamload: peers: %s", exc)
                    docs[folder] = None
            units, why = file_units(header, docs[folder], where)
            if units is None:
                without.append(f"{path.name}: {why}")
            else:
                out[path] = units
        if without:
            some = f"{len(without)} of {len(headers)} files" if out else "any file"
            log.warning(
                "streamload: peers are not used for %s (%s%s): their bytes could not be checked against the "
                "source's digests (write them with `streamload digest` and publish %s beside the weights; %s=1 "
                "uses peers unchecked)", some, without[0], f" and {len(without) - 1} more" if len(without) > 1
                else "", DIGEST_FILE, UNVERIFIED,
            )  # fmt: skip
        if unverified_allowed() and any(u.digest is None for units in out.values() for u in units.units[:1]):
            log.warning("streamload: peers: %s=1: bytes from peers of files without digests are used unchecked",
                        UNVERIFIED)  # fmt: skip
        return out


class PeerFiles(ObjectFiles):
    """The objects of one load, their ranges read from peers where they hold them (`Swarm`), checked unit
    by unit; the rest, and what a peer failed at, from the store (`ObjectFiles.fetch`). What comes back
    is written into the cache as the store's bytes would be (`ObjectFiles.read`)."""

    def __init__(
        self,
        storage: ObjectStorage,
        headers: dict[PurePath, FileHeader],
        partly: Partly,
        swarm: Swarm,
        units: dict[PurePath, Units],
    ) -> None:
        self._swarm, self._units = swarm, units
        self._source_rates: list[float] = []
        self._counts_lock = threading.Lock()
        self.from_peers = self.from_source = 0  # bytes handed out from each
        super().__init__(storage, headers, partly)

    def fetch(self, path: ObjectPath, offset: int, length: int) -> list[memoryview]:
        units = self._units.get(path)
        if units is None or not self._swarm.any_alive():
            return self._source(path, offset, length)
        end, out = offset + length, []
        for start, stop, i, j in units.segments(offset, end):
            lo, hi = max(start, offset), min(stop, end)
            if i == j:
                out += self._source(path, lo, hi - lo)
            else:
                out += self._peers(path, units.units[i:j], lo, hi)
        return out

    def _peers(self, path: ObjectPath, units: list[Unit], lo: int, hi: int) -> list[memoryview]:
        """Bytes [lo, hi) of the file, covered by `units`: fetched whole from a peer, each unit checked;
        from the next peer where one fails, from the source where none is left."""
        start, stop = units[0].start, units[-1].end
        tried: set[Peer] = set()
        while (peer := self._swarm.choose(path, tried)) is not None:
            tried.add(peer)
            data = self._swarm.get(peer, path, start, stop, self._source_rate)
            if data is None:
                continue
            for unit in units:
                piece = memoryview(data)[unit.start - start : unit.end - start]
                if unit.digest is not None and block_digest(piece) != unit.digest:
                    self._swarm.drop(peer, f"sent bytes of {path.name} ({unit.what}) that do not match the "
                                           "source's digests")  # fmt: skip
                    piece[:] = b"".join(self._source(path, unit.start, unit.end - unit.start))
            with self._counts_lock:
                self.from_peers += hi - lo
            return [memoryview(data)[lo - start : hi - start]]
        return self._source(path, lo, hi - lo)

    def _source(self, path: ObjectPath, offset: int, length: int) -> list[memoryview]:
        began = time.monotonic()
        views = super().fetch(path, offset, length)
        took = time.monotonic() - began
        with self._counts_lock:
            self.from_source += length
            if length >= MEASURED and took > 0:
                self._source_rates = [*self._source_rates[-15:], length / took]
        return views

    def _source_rate(self) -> float | None:
        """Bytes a second one request to the source gets (this load's, else the store's pace)."""
        with self._counts_lock:
            rates = list(self._source_rates)
        return statistics.median(rates) if rates else self.storage.pace.rate

    def cancel(self) -> None:
        self._swarm.stop()
        super().cancel()

    def close(self) -> None:
        self._swarm.close()
        super().close()
        total = self.from_peers + self.from_source
        if total:
            log.info("streamload: peers served %d of %d bytes (%.0f%%), the source %d%s", self.from_peers, total,
                     100 * self.from_peers / total, self.from_source, self._swarm.summary())  # fmt: skip


def _line(text: object) -> str:
    """What a peer said, as one short line of a message."""
    return " ".join(str(text).split())[:120]


# -- the peers of one load -----------------------------------------------------------------------------
class _Failed(Exception):
    """A peer's request failed; `drop`: the peer is not asked again this load (else: not for this file)."""

    def __init__(self, why: str, drop: bool = True) -> None:
        super().__init__(why)
        self.drop = drop


class _State:
    """What one load knows of one peer."""

    def __init__(self) -> None:
        self.alive = True
        self.inflight = 0
        self.idle: list[http.client.HTTPConnection] = []
        self.rates: list[float] = []
        self.sent = 0
        self.warned_lacks = False


class Swarm:
    """The peers of one load: which hold each file (asked once a file), which are alive, and their
    connections (kept open between requests, at most `REQUESTS` in flight a peer)."""

    def __init__(self, peers: list[Peer], headers: Mapping[PurePath, FileHeader]) -> None:
        self._peers = peers
        self._state = {p: _State() for p in peers}
        self._tags = {path: version_tag(version_of(h)) for path, h in headers.items()}
        self._sizes = {path: h.size for path, h in headers.items()}
        self._holders: dict[PurePath, list[Peer]] = {}
        self._asking: dict[PurePath, threading.Lock] = {}
        self._lock = threading.Condition()
        self._busy: set[http.client.HTTPConnection] = set()  # connections a request is on (shut by `stop`)
        self._stopped = False
        self._turn = 0
        self._pool = ThreadPoolExecutor(min(16, max(1, len(peers))), "streamload-peers")
        self.timeout = timeout()

    # -- choosing ---------------------------------------------------------------------------------------
    def any_alive(self) -> bool:
        return not self._stopped and any(s.alive for s in self._state.values())

    def choose(self, path: PurePath, tried: Collection[Peer]) -> Peer | None:
        """The live peer holding `path` (not in `tried`) with the fewest requests in flight, counted in;
        waits while all are at `REQUESTS` (at most the timeout). None: no peer is left for this range."""
        holders = self.holders(path)
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while not self._stopped:
                live = [p for p in holders if p not in tried and self._state[p].alive]
                free = [p for p in live if self._state[p].inflight < REQUESTS]
                if free:
                    self._turn += 1
                    peer = min(free, key=lambda p: (self._state[p].inflight, (self._peers.index(p) - self._turn)
                                                    % len(self._peers)))  # fmt: skip
                    self._state[peer].inflight += 1
                    return peer
                left = deadline - time.monotonic()
                if not live or left <= 0:
                    return None
                self._lock.wait(left)
        return None

    def holders(self, path: PurePath) -> list[Peer]:
        """The peers holding the file at `path` at the source's version: asked once (HEAD, all at once)."""
        known = self._holders.get(path)
        if known is not None:
            return known
        with self._lock:
            asking = self._asking.setdefault(path, threading.Lock())
        with asking:
            if path not in self._holders:
                live = [p for p in self._peers if self._state[p].alive]
                has = list(self._pool.map(lambda p: self._has(p, path), live))
                self._holders[path] = [p for p, yes in zip(live, has, strict=True) if yes]
            return self._holders[path]

    def _has(self, peer: Peer, path: PurePath) -> bool:
        try:
            self._request(peer, "HEAD", path, None, lambda response: None)
            return True
        except _Failed as exc:
            self._failed(peer, path, exc)
            return False

    # -- requests ---------------------------------------------------------------------------------------
    def get(self, peer: Peer, path: PurePath, start: int, stop: int, source_rate: Callable[[], float | None]
            ) -> bytearray | None:  # fmt: skip
        """Bytes [start, stop) of `path` from `peer` (counted in by `choose`); None where it failed."""
        data = bytearray(stop - start)
        view = memoryview(data)
        deadline = time.monotonic() + self.timeout + len(data) / FLOOR_RATE

        def body(response: http.client.HTTPResponse) -> None:
            got = 0
            while got < len(data):  # one receive at a time (read1): a peer sending a byte a second meets the deadline
                chunk = response.read1(min(len(data) - got, 1 << 20))
                if not chunk:
                    raise _Failed(f"ended its answer after {got} of {len(data)} bytes")
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
                if got < len(data) and time.monotonic() > deadline:
                    raise _Failed(f"sent {got} of {len(data)} bytes in {self.timeout + len(data) / FLOOR_RATE:.1f} s")

        began = time.monotonic()
        try:
            self._request(peer, "GET", path, (start, stop), body)
        except _Failed as exc:
            self._failed(peer, path, exc)
            return None
        finally:
            with self._lock:
                self._state[peer].inflight -= 1
                self._lock.notify_all()
        took = time.monotonic() - began
        state = self._state[peer]
        with self._lock:
            state.sent += len(data)
            if len(data) >= MEASURED and took > 0:
                state.rates = [*state.rates[-7:], len(data) / took]
            rates = list(state.rates)
        theirs = source_rate() if len(rates) >= SLOW_AFTER else None
        if theirs and statistics.median(rates) < theirs:
            self.drop(peer, f"is slower than the source ({statistics.median(rates) / 1e6:.1f} MB/s a request, "
                            f"the source {theirs / 1e6:.1f} MB/s)")  # fmt: skip
        return data

    def _request(
        self,
        peer: Peer,
        method: str,
        path: PurePath,
        span: tuple[int, int] | None,
        body: Callable[[http.client.HTTPResponse], None],
    ) -> None:
        """One request to `peer`, its answer checked to be the version and range asked for; raises _Failed.
        A kept connection the peer closed meanwhile (its idle timeout) is replaced once, at no cost."""
        headers = {"If-Match": self._tags[path]}
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        for fresh in (False, True):
            connection, reused = self._connection(peer, fresh)
            try:
                connection.request(method, peer.base + url_path(path), headers=headers)
                response = connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._let_go(connection, None)
                if reused:
                    continue
                raise _Failed(f"failed: {type(exc).__name__}: {_line(exc) or 'connection closed'}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._let_go(connection, None)
                raise self._named(exc) from None
            keep = None
            try:
                self._answer(method, path, span, response, body)
                keep = None if response.will_close else peer
            except (OSError, http.client.HTTPException) as exc:
                raise self._named(exc) from None
            finally:
                self._let_go(connection, keep)
            return

    def _answer(
        self,
        method: str,
        path: PurePath,
        span: tuple[int, int] | None,
        response: http.client.HTTPResponse,
        body: Callable[[http.client.HTTPResponse], None],
    ) -> None:
        """Check that `response` is the version and range asked for, then read its body (`body`)."""
        tag, size, status = self._tags[path], self._sizes[path], response.status
        if status in (404, 412):
            response.read()
            raise _Failed(f"does not hold {path.name} (404)" if status == 404 else
                          f"holds another version of {path.name} than the source's (412)", drop=False)  # fmt: skip
        want, length = (206, span[1] - span[0]) if span is not None else (200, size)
        if status != want:
            raise _Failed(f"answered {status} {_line(response.reason)} to a {method}")
        got = {"ETag": response.getheader("ETag"), "Content-Length": response.getheader("Content-Length")}
        expect = {"ETag": tag, "Content-Length": str(length)}
        if span is not None:
            got["Content-Range"] = response.getheader("Content-Range")
            expect["Content-Range"] = f"bytes {span[0]}-{span[1] - 1}/{size}"
        if got != expect:
            wrong = next(k for k in expect if got[k] != expect[k])
            raise _Failed(f"answered {wrong} {_line(got[wrong])!r}, not {expect[wrong]!r}")
        if method == "GET":
            body(response)
        response.read()  # the answer read to its end (nothing is left): its connection can take the next request

    def _named(self, exc: BaseException) -> _Failed:
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            return _Failed(f"did not answer within {self.timeout:g} s")
        return _Failed(f"failed: {type(exc).__name__}: {_line(exc) or 'connection closed'}")

    def _connection(self, peer: Peer, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to `peer` (a kept one unless `fresh`), and whether it was kept."""
        with self._lock:
            if self._stopped:
                raise _Failed("the load was stopped", drop=False)
            idle = self._state[peer].idle
            reused = bool(idle) and not fresh
            connection = idle.pop() if reused else http.client.HTTPConnection(peer.host, peer.port, self.timeout)
            self._busy.add(connection)
        return connection, reused

    def _let_go(self, connection: http.client.HTTPConnection, keep: Peer | None) -> None:
        """A request's connection: kept for `keep`'s next request where its answer was read whole, else closed."""
        with self._lock:
            self._busy.discard(connection)
            if keep is not None and self._state[keep].alive and not self._stopped:
                self._state[keep].idle.append(connection)
                return
        connection.close()

    # -- failures ---------------------------------------------------------------------------------------
    def _failed(self, peer: Peer, path: PurePath, exc: _Failed) -> None:
        if self._stopped:
            return
        if exc.drop:
            self.drop(peer, f"{exc} (asked for {path.name})")
            return
        with self._lock:
            holders = self._holders.get(path)
            if holders is not None and peer in holders:
                self._holders[path] = [p for p in holders if p != peer]
            state = self._state[peer]
            first, state.warned_lacks = not state.warned_lacks, True
        (log.warning if first else log.debug)(
            "streamload: peer %s %s: not asked for it again this load (the other peers and the source serve it)",
            peer.name, exc,
        )  # fmt: skip

    def drop(self, peer: Peer, why: str) -> None:
        """`peer` asked no more this load; one warning naming it."""
        with self._lock:
            state = self._state[peer]
            if not state.alive:
                return
            state.alive = False
            idle, state.idle = state.idle, []
            self._lock.notify_all()
        for connection in idle:
            connection.close()
        log.warning("streamload: peer %s %s: dropped for the rest of this load (the other peers and the source "
                    "serve)", peer.name, why)  # fmt: skip

    def summary(self) -> str:
        with self._lock:
            served = [f"{p.name} {self._state[p].sent}" for p in self._peers if self._state[p].sent]
        return f" ({', '.join(served)})" if served else ""

    def stop(self) -> None:
        """Requests in flight end at once (their connections shut): the load is being stopped."""
        with self._lock:
            self._stopped = True
            busy = list(self._busy)
            self._lock.notify_all()
        for connection in busy:
            sock = connection.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            idle = [c for s in self._state.values() for c in s.idle]
            for s in self._state.values():
                s.idle = []
        for connection in idle:
            connection.close()


__all__ = ["DEFAULT_PORT", "PREFIX", "UNVERIFIED", "Peer", "PeerFiles", "PeerStorage", "Swarm", "names",
           "resolve", "url_path", "version_tag", "with_peers"]  # fmt: skip
