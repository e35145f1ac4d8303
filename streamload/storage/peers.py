"""Peers: a remote checkpoint's bytes from nodes that hold complete copies of its files (`streamload seed`,
servers/seed.py), or load them at the same time (a wave: wave.py), over plain HTTP ranges, each block checked
against the source's digests before use; the source (the object store) serves what no peer has, and
everything a peer fails at. docs/peers.md tells users.

Protocol: the file the source URL `scheme://host/key` names is `GET /v1/<scheme>/<host>/<key>` on a peer (the
cache's own layout, storage/cache.py), with `Range: bytes=a-b`, `If-Match: <tag>` (`version_tag`: the version
the source's header named) and `X-Streamload-Proof` (storage/peer_proof.py). A peer holding a complete copy of
that version answers 206 with that ETag; another version 412; no copy 404; a proof it refuses 403; 503 at its
connection cap. A node loading the file (`X-Streamload-Copy: loading`) serves what it verified, and has a
request that names `X-Streamload-Wait` wait for the rest that long (storage/verified.py).

A load (`PeerFiles`) reads each range from the peer with the fewest requests in flight (at most `REQUESTS`),
whole digest blocks at a time, so that every block passes the integrity layer (integrity/blocks.py) against the
source's digest file before a byte of it is used. A block failing it is read from the source, and checked too:
where the source's fails as well, the digest file is stale (peers not used for that file; the peer not blamed).
A peer that fails (down, a timeout, an answer that is not the range asked for, a forged block, slower than the
source) is dropped for the load, with one warning; one without the file (404, 412) or refusing our proof (403)
is not asked for that file again; a busy one (503) is asked again after its Retry-After (at most `RETRY_CAP` s)
and dropped after `BUSY_TIMEOUTS` timeouts of nothing else. Each request ends by its deadline (`_Watchdog`),
and only the answer asked for is read: a peer can delay a load by its timeout, never fail it. Files without
usable digests are read from the source alone, unless `STREAMLOAD_PEERS_UNVERIFIED=1`: then a peer's bytes of
them are used as sent, and the load keeps no copy of those files in its cache.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import http.client
import json
import logging
import math
import re
import socket
import ssl
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePath
from typing import Any, NamedTuple
from urllib.parse import quote, urlsplit

from streamload.base import settings
from streamload.base.errors import SourceError
from streamload.format.header import FileHeader
from streamload.integrity.blocks import Outcome, Unit, Units, origin_units
from streamload.integrity.digests import DIGEST_FILE, version_of
from streamload.storage import cache, peer_proof
from streamload.storage.base import Copied, Digest, Listing, Partly, Source, redacted
from streamload.storage.remote import ObjectFiles, ObjectPath, ObjectStorage, origin_digests
from streamload.storage.verified import CLAIMED, COPY, LONG_POLL, NODE, WAIT, claims, node_of
from streamload.storage.wave import (
    REPROBE,
    REPROBE_MOST,
    TOGETHER,
    Ahead,
    Known,
    Member,
    Segment,
    Segments,
    Slots,
    owner,
)

log = logging.getLogger("streamload")

DEFAULT_PORT = 8470
PREFIX = "/v1/"
UNVERIFIED = settings.PEERS_UNVERIFIED.name
PEER_CA = settings.PEER_CA.name  # the CA file https:// peers' certificates are checked against
REQUESTS = 4  # requests in flight to one peer at once, per load
UNCHECKED_BLOCK = 1 << 20  # the pieces of a file without digests (STREAMLOAD_PEERS_UNVERIFIED=1)
MEASURED = 1 << 20  # requests this large tell a peer's rate
SLOW_AFTER = 3  # measured requests before a peer's rate is judged against the source's
FLOOR_RATE = 1e6  # bytes a second a request gets on top of the timeout before it is given up
SOONER = 1.0  # seconds a range's request gets before its bytes at the source's rate count (a range from a peer
# slower than the source is then read from the source: the peer loses its ranges within about a second)
SOURCE_RATE = 25e6  # bytes a second assumed of the source before any of this load's reads measured it
RETRY_CAP = 2.0  # the most seconds a 503's Retry-After keeps a peer from being asked again
RETRY_FLOOR = 0.25  # the least (a peer cannot have a load ask again at once)
BUSY_TIMEOUTS = 3  # a peer answering nothing but 503 for this many timeouts is dropped
Peers = str | Sequence[str]
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def url_path(path: PurePath) -> str:
    """The URL path a peer serves the object at `path` (an ObjectPath) under: its place in a cache."""
    return PREFIX + "/".join(quote(name, safe="") for name in cache.cache_path(Path(), path).parts)


def version_tag(version: Mapping[str, object]) -> str:
    """The strong ETag of one version of an object (a cache record's size and version): equal on every node
    that holds that version, whatever its cache directory."""
    named = json.dumps({"size": version["size"], "version": version["version"]}, sort_keys=True)
    return '"' + hashlib.sha256(named.encode()).hexdigest()[:40] + '"'


def timeout() -> float:
    """Seconds a peer may take to connect, or between bytes (`STREAMLOAD_PEER_TIMEOUT`)."""
    return max(0.05, settings.PEER_TIMEOUT.get())


def unverified_allowed() -> bool:
    return settings.PEERS_UNVERIFIED.get()


def wave_wait(nbytes: int = 0, rate: float | None = None) -> float:
    """Seconds a request to a node loading the file may wait there for `nbytes` to be verified (a long poll): twice
    the peers' timeout, or three times what the owner takes to read them at one request's `rate` from the source
    (bytes a second) where that is longer (a wave's first segments all come from the store at once), at most
    `LONG_POLL` s (the seeder's cap)."""
    took = nbytes / rate if rate else 0.0
    return min(LONG_POLL, max(2 * timeout(), 3 * took))


# -- who the peers are ---------------------------------------------------------------------------------
class Peer(NamedTuple):
    """One peer: an address to connect to, and how messages name it."""

    name: str
    host: str  # an address (IPv6 without brackets)
    port: int
    base: str  # a path the peer's URLs start with ("" for none)
    tls: bool  # https://
    server_name: str  # the name it was given as (its certificate must name it)


def names(peers: Peers | None) -> list[str]:
    """The entries of `peers=`: a list, or text with commas between them (empty ones left out). Raises
    TypeError naming an entry that is not text (`[None, 5]` is a mistake, not a list of no peers)."""
    if peers is None:
        return []
    entries = peers.split(",") if isinstance(peers, str) else list(peers)
    bad = next((i for i, e in enumerate(entries) if not isinstance(e, str)), None)
    if bad is not None:
        raise TypeError(f"peers[{bad}] must be a URL or a host name (text), not {type(entries[bad]).__name__} "
                        f"{entries[bad]!r}")  # fmt: skip
    return [e.strip() for e in entries if e.strip()]


def entry_shown(entry: str) -> str:
    """A `peers=` entry as a message shows it: its user info (`user:password@`) as `***@`, also where it
    has no scheme (`host[:port]` form)."""
    return redacted(entry) if "://" in entry else redacted(f"http://{entry}").removeprefix("http://")


def _parsed(entry: str) -> tuple[str, int, str, bool] | None:
    """(host, port, base path, https) of a peer's URL or `host[:port]`; None where it is neither."""
    if "://" in entry and not entry.startswith(("http://", "https://")):
        return None
    try:
        parts = urlsplit(entry if "://" in entry else f"http://{entry}")
        port = parts.port or DEFAULT_PORT
    except ValueError:
        return None
    host = parts.netloc.rsplit(":", 1)[0] if parts.port else parts.netloc
    if not host or not _HOST.fullmatch(host) or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    return (parts.hostname or host), port, parts.path.rstrip("/"), parts.scheme == "https"


def resolve(peers: Peers | None) -> list[Peer]:
    """The peers `peers=` names: each entry's name resolved to its addresses, each address a peer (once).
    An entry that is not a peer's URL, or a name that resolves to nothing, is left out with a warning.
    An https:// peer is reached at each address, its certificate checked for the name as given."""
    out: dict[tuple[str, int, str, bool], Peer] = {}
    for entry in names(peers):
        parsed = _parsed(entry)
        if parsed is None:
            log.warning("streamload: peers: %r is not a peer (http://host:port, https://host:port, host:port, or "
                        "a name whose addresses are the peers): left out", entry_shown(entry))  # fmt: skip
            continue
        host, port, base, tls = parsed
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            log.warning("streamload: peers: %s resolves to no address (%s): left out", redacted(host), exc)
            continue
        for *_, address in found:
            ip = str(address[0])
            shown = f"{'https' if tls else 'http'}://{f'[{ip}]' if ':' in ip else ip}:{port}{base}"
            named = shown if ip == host else f"{shown} ({host})"
            out.setdefault((ip, port, base, tls), Peer(named, ip, port, base, tls, host))
    return list(out.values())


# -- the storage ---------------------------------------------------------------------------------------
class Tally:
    """Bytes this process's loads with peers handed out from peers and from the source (each load's
    `PeerFiles`, at its close): what `streamload load --peers` reports, as the difference across its load."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = (0, 0)

    def add(self, peers: int, source: int) -> None:
        with self._lock:
            self._counts = (self._counts[0] + peers, self._counts[1] + source)

    def read(self) -> tuple[int, int]:
        """(bytes from peers, bytes from the source) so far."""
        return self._counts  # replaced whole: read without the lock


TALLY = Tally()


def with_peers(storage: Any, peers: Peers | None) -> Any:
    """`storage` reading from `peers` first where it is an object storage (s3://, gs://, http(s)://, ...);
    else `storage` itself (a local file, a cache's complete copy, a hub id: said once at INFO)."""
    if not names(peers):
        return storage
    if not isinstance(storage, ObjectStorage):
        log.info("streamload: peers are asked for the files of object stores' URLs; this one is read from %s",
                 type(storage).__name__)  # fmt: skip
        return storage
    return PeerStorage(storage, peers)


class PeerStorage:
    """An object storage whose loads read the ranges peers hold from them (see the module's docstring);
    everything else is the object storage's."""

    def __init__(self, inner: ObjectStorage, peers: Peers) -> None:
        self.inner, self.peers = inner, peers
        self.local, self.first_batch = inner.local, inner.first_batch
        self.root, self.cache_dir = inner.root, inner.cache_dir

    def locate(self, source: Source) -> Listing:
        return self.inner.locate(source)

    def header(self, path: PurePath) -> FileHeader:
        return self.inner.header(path)

    def cached(self, headers: tuple[FileHeader, ...]) -> Copied | None:
        return self.inner.cached(headers)

    def digest(self, header: FileHeader) -> Digest | None:
        return self.inner.digest(header)

    def held_until_checked(self) -> PeerStorage:
        return self  # nothing it serves waits for a verdict

    def sidecar(self, near: PurePath, name: str) -> bytes | None:
        return self.inner.sidecar(near, name)

    def open(self, headers: dict[PurePath, FileHeader], partly: Partly = None) -> ObjectFiles:
        units = self._units(headers)
        peers = resolve(self.peers) if units else []
        if not peers:
            if units:
                log.info("streamload: peers: none of %s names a peer: this load reads from the source",
                         ", ".join(map(entry_shown, names(self.peers))))  # fmt: skip
            return self.inner.open(headers, partly)

        def files(storage: ObjectStorage, headers: dict[PurePath, FileHeader], partly: Partly) -> ObjectFiles:
            return PeerFiles(storage, headers, partly, Swarm(peers, headers, node_of(self.cache_dir)), units)

        return self.inner.open(headers, partly, files)

    def _units(self, headers: dict[PurePath, FileHeader]) -> dict[PurePath, Units]:
        """The units peers may serve, by file: its origin-bound blocks (integrity/blocks.py), or with
        `STREAMLOAD_PEERS_UNVERIFIED=1` unchecked pieces; what the source publishes no digests of is said once."""
        docs = origin_digests(self.inner, headers)  # a file that cannot be read: why, said in the one warning below
        unchecked = unverified_allowed()
        if unchecked:  # files read from peers unchecked: no warning below says why their digests are not
            for _, broken in docs.values():
                if broken:
                    log.warning("streamload: peers: %s", broken)
        out: dict[PurePath, Units] = {}
        without: list[str] = []
        for path, header in headers.items():
            doc, broken = docs[path.parent]
            where = f"{path.parent}/{DIGEST_FILE}"
            units, why = origin_units(header, doc, where, version_of(header, self.inner.digest(header)))
            if units is None and unchecked:
                units = Units([Unit(a, min(a + UNCHECKED_BLOCK, header.size), None, f"bytes {a}..") for a in
                               range(header.data_start, header.size, UNCHECKED_BLOCK)])  # fmt: skip
            if units is None:
                without.append(f"{path.name}: {broken or why}")
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
        if unchecked and any(u.digest is None for units in out.values() for u in units.units[:1]):
            log.warning("streamload: peers: %s=1: bytes from peers of files without digests are used unchecked",
                        UNVERIFIED)  # fmt: skip
        return out


class PeerFiles(ObjectFiles):
    """The objects of one load, their ranges read from peers where they hold them (`Swarm`), checked unit
    by unit; the rest, and what a peer failed at, from the store (`ObjectFiles.fetch`). What comes back
    is written into the cache as the store's bytes would be (`ObjectFiles.read`).

    A file that nodes load together (`Swarm.in_wave`) is read segment by segment (wave.py): from a complete
    copy where a peer has one, else from the segment's owner, which reads it from the source; this node's own
    segments are read ahead of the pipeline (`Ahead`). What this node verified of a file it writes into the
    cache is marked there, and its seeder serves it to the others (storage/verified.py)."""

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
        self._changed: set[PurePath] = set()  # files whose own copy changed after it was checked (said once)
        super().__init__(storage, headers, partly)
        checked = {p: u for p, u in units.items() if u.units and all(x.digest is not None for x in u.units)}
        self._segments = {p: Segments(u) for p, u in checked.items()}  # the files a wave may split
        self._slots = Slots()
        copies, files = self._copies, []
        for path, segments in self._segments.items():
            verified = None if copies is None or swarm.node is None else copies.verified(path)
            if verified is not None:
                files.append((path, segments, verified))
        self._ahead = Ahead(files, swarm.mine, self._read_ahead, swarm.generation, swarm.asked) if files else None

    def fetch(self, path: ObjectPath, offset: int, length: int) -> list[memoryview]:
        units = self._units.get(path)
        if units is None or not self._swarm.any_alive():
            return self._source(path, offset, length)
        end, out = offset + length, []
        if path in self._segments and self._swarm.in_wave(path):
            for start, stop, i, j in self._segments[path].over(offset, end):
                lo, hi = max(start, offset), min(stop, end)
                out += self._source(path, lo, hi - lo) if i == j else [self._segment(path, (start, stop, i, j), lo, hi)]
            return out
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
        units_of = self._units.get(path)
        if units_of is None:  # found stale meanwhile
            return self._source(path, lo, hi - lo)
        tried: set[Peer] = set()
        while (peer := self._swarm.choose(path, tried)) is not None:
            tried.add(peer)
            data = self._swarm.get(peer, path, start, stop, self._source_rate)
            if data is not None:
                self._settle(path, peer, units_of, units, data, (lo, hi))
                return [memoryview(data)[lo - start : hi - start]]
        return self._source(path, lo, hi - lo)

    def _settle(
        self, path: ObjectPath, peer: Peer | None, units_of: Units, units: list[Unit], data: bytearray,
        counted: tuple[int, int],
    ) -> bool:  # fmt: skip
        """Check `data` (the bytes of `units`, from `peer`, or the source's where None), unit by unit (a unit
        that fails replaced by the source's, checked too); whether every unit is verified now. The peer's bytes
        within `counted` are counted as the peers'."""
        start = units[0].start
        refetched: list[tuple[int, int]] = []  # units settle read from the source: not the peer's bytes

        def from_source(at: int, n: int) -> bytes:
            refetched.append((at, at + n))
            return b"".join(self._source(path, at, n))

        outcome, failed = units_of.settle(units, memoryview(data), start, from_source)
        if outcome is Outcome.FORGED and failed is not None and peer is not None:
            self._swarm.drop(peer, f"sent bytes of {path.name} ({failed.what}) that do not match the source's digests")
        elif outcome is Outcome.STALE and failed is not None:
            # the source's bytes fail too: the digests do not describe its version (the peer is not blamed),
            # and the peer's other blocks matched nothing that proves them
            if peer is not None:
                memoryview(data)[:] = b"".join(self._source(path, start, len(data)))
                refetched.append(counted)
            if self._units.pop(path, None) is not None:  # said once; peers not used for the file again
                log.warning("streamload: %s does not describe %s as the source holds it now (%s fails it from "
                            "the source too): it is stale; peers are not used for this file (write it anew "
                            "with `streamload digest`)", units_of.where, path.name, failed.what)  # fmt: skip
            self.unkept(path)  # blocks of it taken from peers earlier were checked against those digests
        elif outcome is Outcome.UNCHECKED:
            self.unkept(path)  # unchecked bytes never become a copy a later load would trust
        if peer is not None:
            lo, hi = counted
            with self._counts_lock:
                self.from_peers += hi - lo - sum(max(0, min(b, hi) - max(a, lo)) for a, b in refetched)
        return outcome in (Outcome.MATCHED, Outcome.FORGED)

    # -- waves --------------------------------------------------------------------------------------------
    def _segment(self, path: ObjectPath, segment: Segment, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of the file, within one segment of its wave: as this load verified them (kept in its
        cache copy), else the whole segment fetched (`_obtain`) by this thread, or by the one reading it."""
        copies = self._copies if self._copies is not None and self._copies.writes(path) else None
        start = segment[0]
        while True:
            kept = None if copies is None else copies.read_verified(path, start, segment[1])
            if kept is not None:
                return self._read_back(path, segment, kept)[lo - start : hi - start]
            busy = None if copies is None else self._slots.take(path, start)
            if busy is not None:
                busy.wait()  # its reader ends it (its requests have deadlines)
                continue
            try:
                data = self._obtain(path, segment)
            finally:
                if copies is not None:
                    self._slots.done(path, start)
            return memoryview(data)[lo - start : hi - start]

    def _read_back(self, path: ObjectPath, segment: Segment, data: memoryview) -> memoryview:
        """A segment this load verified, read back from its own copy, checked again before a byte of it is handed
        out: the file on disk is not the bytes that were checked (a failing disk, another writer of the cache).
        A unit that fails is the source's (checked too); the copy is then not kept."""
        start, end, i, j = segment
        units_of = self._units.get(path)
        if units_of is None:  # found stale meanwhile: the digests prove nothing
            return memoryview(_joined(self._source(path, start, end - start)))
        outcome, failed = units_of.settle(units_of.units[i:j], data, start,
                                          lambda at, n: b"".join(self._source(path, at, n)))  # fmt: skip
        with self._counts_lock:
            first = outcome is not Outcome.MATCHED and path not in self._changed
            if first:
                self._changed.add(path)
        if first and failed is not None:
            log.warning("streamload: %s: this load's own copy in the cache changed after it was checked (%s): read "
                        "from the source; the copy is not kept", path.name, failed.what)  # fmt: skip
        if outcome is not Outcome.MATCHED:
            self.unkept(path)
        return data

    def _read_ahead(self, path: PurePath, segment: Segment) -> None:
        """One segment this node owns, fetched ahead of the pipeline (`Ahead`): where no thread reads it yet."""
        assert isinstance(path, ObjectPath)
        busy = self._slots.take(path, segment[0])
        if busy is not None:
            busy.wait()
            return
        try:
            self._obtain(path, segment)
        finally:
            self._slots.done(path, segment[0])

    def _obtain(self, path: ObjectPath, segment: Segment) -> bytearray:
        """The bytes of one segment, checked, and kept in the cache copy as verified where they are: from a peer
        that holds a complete copy, else from the segment's owner (a long poll while it verifies them), else
        (this node owns it, or the owners failed) from the source."""
        start, end, i, j = segment
        units_of = self._units.get(path)
        if units_of is None:  # found stale meanwhile
            return _joined(self._source(path, start, end - start))
        units = units_of.units[i:j]
        tried: set[Peer] = set()
        polls = wave_wait(end - start, self._source_rate())  # what a request to an owner may wait there
        while (peer := self._swarm.choose(path, tried)) or (peer := self._swarm.owner(path, start, tried, polls)):
            tried.add(peer)
            holder = peer in self._swarm.holders(path)
            wait = 0.0 if holder else polls
            data = self._swarm.get(peer, path, start, end, self._source_rate, wait)
            if data is not None:
                if self._settle(path, peer, units_of, units, data, (start, end)):
                    self._keep(path, start, data)
                return data
            if not holder and self._swarm.alive(peer):
                break  # its owner had not verified it in time: the source's, not a node's that does not know it owns it
        verified = self._copies.verified(path) if self._copies is not None else None
        if verified is not None:  # a node that joins the wave now leaves it to this one (verified.CLAIMED)
            verified.reading(start, end)
        try:
            data = _joined(self._source(path, start, end - start))
        finally:
            if verified is not None:
                verified.reading(start, end, add=False)
        writes = self._copies is not None and self._copies.writes(path)
        if writes and self._settle(path, None, units_of, units, data, (start, start)):
            self._keep(path, start, data)  # checked: the wave's other nodes may ask for it (and other reads here)
        return data

    def _keep(self, path: PurePath, start: int, data: bytearray) -> None:
        """Verified bytes into the cache copy, marked so (after they are written: a seeder serves them)."""
        if self._copies is not None:
            self._copies.write(path, start, memoryview(data), checked=True)

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
        self.cancel()  # requests in flight end, the fetcher's too
        if self._ahead is not None:
            self._ahead.close()
        self._swarm.close()
        super().close()
        total = self.from_peers + self.from_source
        TALLY.add(self.from_peers, self.from_source)
        if total:
            log.info("streamload: peers served %d of %d bytes (%.0f%%), the source %d%s", self.from_peers, total,
                     100 * self.from_peers / total, self.from_source, self._swarm.summary())  # fmt: skip


def _joined(views: list[memoryview]) -> bytearray:
    """`views` one after the other, in one buffer of their own (copied once)."""
    out = bytearray(sum(len(v) for v in views))
    at = 0
    for view in views:
        out[at : at + len(view)] = view
        at += len(view)
    return out


def _line(text: object) -> str:
    """What a peer said, as one short line of a message."""
    return " ".join(str(text).split())[:120]


# -- the peers of one load -----------------------------------------------------------------------------
class _Failed(Exception):
    """A peer's request failed; `drop`: the peer is not asked again this load (else: not for this file);
    `refused`: it answered 403 (our proof of reading was not accepted); `unbound`: nothing listens there (yet)."""

    def __init__(self, why: str, drop: bool = True, refused: bool = False, late: bool = False, node: str = "",
                 unbound: bool = False) -> None:  # fmt: skip
        super().__init__(why)
        self.drop, self.refused, self.late = drop, refused, late  # late: its deadline cut it
        self.node = node  # a 404's: the node a seeder that lacks the file serves for
        self.unbound = unbound  # connection refused: a node starting with this one may not have bound its seeder


class _Answer(NamedTuple):
    """What a peer's HEAD said of a file: "complete", "loading" (since: when its copy began, by its clock) or
    "idle" (a seeder without it); the node it serves for, where it named one."""

    kind: str
    node: str | None
    since: float
    failure: _Failed | None = None  # an "idle" peer's where nothing listened at it (a node not up yet)
    claims: tuple[tuple[int, int], ...] = ()  # a "loading" one's: what it verified or reads now (verified.CLAIMED)


class _Busy(_Failed):
    """A peer answered 503 (at its connection cap): asked again after `wait` seconds, not dropped."""

    def __init__(self, why: str, wait: float) -> None:
        super().__init__(why, drop=False)
        self.wait = wait


def _retry_after(value: str | None) -> float:
    """Seconds a 503's `Retry-After` (seconds or an HTTP date) asks for, within [RETRY_FLOOR, RETRY_CAP]:
    a peer cannot hold a load up for long, nor have it ask again at once (1 s where it names none)."""
    wait, text = 1.0, (value or "").strip()
    with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):  # not a time: the default
        if text.isascii() and text.isdigit():
            wait = float(text)
        elif text:
            wait = email.utils.parsedate_to_datetime(text).timestamp() - time.time()
    return min(RETRY_CAP, max(RETRY_FLOOR, wait))


def _tls_context() -> tuple[ssl.SSLContext, str]:
    """The context https:// peers are verified with, and what it trusts (for messages): the CA file
    `STREAMLOAD_PEER_CA` names, else the system's store. Raises ValueError naming a file it cannot load."""
    ca = settings.PEER_CA.get()
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ValueError(f"{ca}: cannot load the CA certificates peers are checked against ({PEER_CA}): "
                         f"{_line(exc)}") from None  # fmt: skip
    return context, (f"{PEER_CA}={ca}" if ca else f"the system's CA store ({PEER_CA} is unset)")


class _Connection(http.client.HTTPConnection):
    """A connection to one peer, over TLS where its URL is https:// (verified for the name it was given,
    whatever address it was reached at), that `_Watchdog` can cut at any point: the connect, the TLS
    handshake, the headers, the body."""

    def __init__(self, peer: Peer, timeout: float, tls: ssl.SSLContext | None) -> None:
        super().__init__(peer.host, peer.port, timeout=timeout)
        self._tls, self._server_name = (tls if peer.tls else None), peer.server_name
        self.expired = False  # the watchdog cut it (its request ran past its deadline)
        self._between = timeout  # seconds a receive may wait, but for a long poll's answer

    def allow(self, wait: float) -> None:
        """The next request's answer may take `wait` seconds more to start (a long poll; 0: none)."""
        self.timeout = self._between + wait
        if self.sock is not None:
            self.sock.settimeout(self.timeout)

    def connect(self) -> None:
        super().connect()  # TCP, at most `timeout` seconds
        if self._tls is not None:
            wrapped = self._tls.wrap_socket(self.sock, server_hostname=self._server_name,
                                            do_handshake_on_connect=False)  # fmt: skip
            self.sock = wrapped  # before the handshake: a deadline during it shuts this socket
        if self.expired:  # the deadline passed before `sock` could be shut
            raise TimeoutError("the request's deadline passed while connecting")
        if self._tls is not None:
            self.sock.do_handshake()

    def expire(self) -> None:
        """End whatever the request is doing now: its socket shut both ways (the owner closes it)."""
        self.expired = True
        sock = self.sock  # read once: the request's thread may close it (None) meanwhile
        if sock is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the socket's own, also under TLS


def _late(connection: _Connection, limit: float) -> str | None:
    """How long `connection`'s request was given, where the watchdog cut it; else None."""
    return f"{limit:.3g} s" if connection.expired else None


class _Watchdog:
    """The deadlines of a load's requests to peers: a request still running at its deadline has its
    connection shut (`_Connection.expire`), whatever it waits for (a connect, dripped headers, a body).
    One thread a load, started with its first request."""

    def __init__(self) -> None:
        self._due: dict[_Connection, float] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, connection: _Connection, deadline: float) -> None:
        with self._cond:
            if self._closed:
                connection.expire()
                return
            connection.expired = False
            self._due[connection] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="streamload-peers-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self, connection: _Connection) -> None:
        with self._cond:
            self._due.pop(connection, None)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for connection in [c for c, due in self._due.items() if due <= now]:
                    del self._due[connection]
                    connection.expire()
                self._cond.wait(min(self._due.values(), default=now + 60.0) - now)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()


@dataclass
class _State:
    """What one load knows of one peer."""

    alive: bool = True
    inflight: int = 0
    idle: list[_Connection] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    sent: int = 0
    warned: set[str] = field(default_factory=set)  # what it was warned of once: "refused", "lacks"
    busy_until: float = 0.0  # a 503's Retry-After: not asked again before (monotonic)
    busy_since: float | None = None  # its first 503 since it last answered otherwise


class Swarm:
    """The peers of one load: which hold each file (asked once a file), which load it with this node (its
    wave), which are alive, and their connections (kept open between requests, at most `REQUESTS` in flight a
    peer). `node`: this node's id, where a seeder of this process serves the load's cache (its answers name
    it). Raises SourceError (a ValueError) naming the file where the peers' token file (`peer_proof.token`)
    or CA file cannot be read."""

    def __init__(self, peers: list[Peer], headers: Mapping[PurePath, FileHeader], node: str | None = None) -> None:
        try:  # once a load: a file that cannot be read fails it here, before a request (one line: a SourceError)
            secret = peer_proof.token()
            self._tls, self._trusts = _tls_context() if any(p.tls for p in peers) else (None, "")
        except ValueError as exc:
            raise SourceError(f"peers: {exc}") from None
        self._peers = peers
        self._state = {p: _State() for p in peers}
        self._tags = {path: version_tag(cache.version_of(h)) for path, h in headers.items()}  # as a cache records it
        self._keys = {path: peer_proof.read_key(h.prefix, self._tags[path], secret) for path, h in headers.items()}
        self._sizes = {path: h.size for path, h in headers.items()}
        self.node = node
        self._known: dict[PurePath, Known[Peer]] = {}
        self._asking: dict[PurePath, threading.Lock] = {}
        self._generation = 0
        self._lock = threading.Condition()
        self._busy: set[_Connection] = set()  # connections a request is on (shut by `stop`)
        self._stopped = False
        self._turn = 0
        self._pool = ThreadPoolExecutor(min(16, max(1, len(peers))), "streamload-peers")
        self._watchdog = _Watchdog()
        self.timeout = timeout()
        self.busy_limit = max(RETRY_CAP, BUSY_TIMEOUTS * self.timeout)  # s of nothing but 503 before a drop

    # -- choosing ---------------------------------------------------------------------------------------
    def alive(self, peer: Peer) -> bool:
        return self._state[peer].alive

    def any_alive(self) -> bool:
        return not self._stopped and any(s.alive for s in self._state.values())

    def choose(self, path: PurePath, tried: Collection[Peer]) -> Peer | None:
        """The live peer holding `path` (not in `tried`) with the fewest requests in flight, counted in;
        waits while all are at `REQUESTS` (at most the timeout) or busy (503: until their Retry-After).
        None: no peer is left for this range."""
        holders = self.holders(path)
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while not self._stopped:
                now = time.monotonic()
                live = [p for p in holders if p not in tried and self._state[p].alive]
                free = [p for p in live if self._state[p].inflight < REQUESTS and self._state[p].busy_until <= now]
                if free:
                    self._turn += 1
                    peer = min(free, key=lambda p: (self._state[p].inflight, (self._peers.index(p) - self._turn)
                                                    % len(self._peers)))  # fmt: skip
                    self._state[peer].inflight += 1
                    return peer
                # a busy peer (503) is waited for until its Retry-After (at most RETRY_CAP s), and its slots,
                # held by requests waiting it out, a timeout longer
                until = [self._state[p].busy_until for p in live]
                end = max(deadline, max(until, default=0.0) + self.timeout)
                if not live or now >= end:
                    return None
                self._lock.wait(min([end, *(u for u in until if u > now)]) - now)
        return None

    def holders(self, path: PurePath) -> list[Peer]:
        """The peers holding a complete copy of the file at `path` at the source's version."""
        return self.known(path).holders

    def known(self, path: PurePath) -> Known[Peer]:
        """What the peers said of the file at `path`: asked once (HEAD, all at once); the seeders that lack it
        asked again while nodes may still join this node's wave for it (`wave.TOGETHER`)."""
        known = self._known.get(path)
        if known is None:
            with self._lock:
                asking = self._asking.setdefault(path, threading.Lock())
            with asking:
                if path not in self._known:
                    live = [p for p in self._peers if self._state[p].alive]
                    answers = list(self._pool.map(lambda p: self._has(p, path), live))
                    self._known[path] = self._learnt(path, live, answers)
                known = self._known[path]
        if known.idle:
            self._ask_again(path, known)
        return known

    def _learnt(self, path: PurePath, peers: list[Peer], answers: list[_Answer | None]) -> Known[Peer]:
        """What `answers` (HEADs' to `peers`) tell of the file at `path`."""
        known: Known[Peer] = Known(asked=time.monotonic())
        idle = []
        for peer, answer in zip(peers, answers, strict=True):
            if answer is None:
                continue
            if answer.node is not None and answer.node == self.node:  # this node's own seeder
                known.since = answer.since if answer.kind == "loading" else known.since
            elif answer.kind == "complete":
                known.holders.append(peer)
            elif answer.kind == "loading" and answer.node:
                known.members.setdefault(answer.node, Member(peer, answer.since, answer.claims))
            elif answer.kind == "idle":
                idle.append((peer, answer.node or "", answer.failure))
        # a seeder without the file (or not listening yet, node ""): it may be about to load it too, where this
        # node does
        for peer, node, failure in idle:
            if known.since is not None:
                known.idle[peer] = node
            else:
                self._failed(peer, path, failure or _Failed(f"does not hold {path.name} (404)", drop=False))
        return known

    def _ask_again(self, path: PurePath, known: Known[Peer]) -> None:
        """The seeders that lacked the file asked again, by one thread at a time (the others read on with what
        is known), soon at first and then less often (`Known.every`), while nodes may join the wave; past that,
        forgotten: what they would have owned is read here."""
        now = time.monotonic()
        with self._lock:
            if not known.idle or known.asking or now - known.asked < known.every or self._stopped:
                return
            closed = not known.joining(time.time())
            if closed:
                unbound, known.idle = [p for p, node in known.idle.items() if not node], {}
                self._generation += 1
            else:
                known.asking, idle = True, list(known.idle)
        if closed:
            for peer in unbound:  # asked again until the window closed, nothing listened: down
                self.drop(peer, self._NOT_UP)
            return
        try:
            answers = list(self._pool.map(lambda p: self._has(p, path), idle))
        finally:
            with self._lock:
                known.asking, known.asked, known.every = False, time.monotonic(), min(REPROBE_MOST, 2 * known.every)
        with self._lock:
            for peer, answer in zip(idle, answers, strict=True):
                if answer is not None and answer.kind == "idle":
                    if answer.node and peer in known.idle:  # up now: the node it serves for is known
                        known.idle = {**known.idle, peer: answer.node}
                    continue
                known.idle = {p: n for p, n in known.idle.items() if p != peer}  # (new: others read them unlocked)
                if answer is not None and answer.kind == "loading" and answer.node:
                    known.members = {answer.node: Member(peer, answer.since, answer.claims), **known.members}
                    continue
                self._generation += 1  # it will not join: what it would have owned is the others'
                if answer is not None and answer.kind == "complete":
                    known.holders = [*known.holders, peer]

    def _has(self, peer: Peer, path: PurePath) -> _Answer | None:
        """What `peer` holds of `path` (None: nothing, said); one that is busy (503) is taken at its word that it
        may hold it: its first range request says (a 404 or 412 then leaves it out for the file)."""
        try:
            node, copy, claimed = self._request(peer, "HEAD", path)
        except _Busy as exc:
            return _Answer("complete", None, 0.0) if self._on_busy(peer, path, exc, wait=False) else None
        except _Failed as exc:
            if exc.node:
                return _Answer("idle", exc.node, 0.0)  # a seeder's: whether that says it lacks it, `_learnt` says
            if exc.unbound:  # a node started with this one binds its seeder a moment later: `_learnt` says
                return _Answer("idle", None, 0.0, exc)
            self._failed(peer, path, exc)
            return None
        with self._lock:
            self._state[peer].busy_since = None  # it answered as asked
        kind, _, since = (copy or "complete").partition("; since=")
        if kind != "loading":
            return _Answer("complete", node, 0.0)
        try:
            began = float(since)
        except ValueError:
            return None  # a copy in progress that says neither its node nor its start: of no use to a wave
        if not node or not math.isfinite(began) or began > time.time() + TOGETHER:
            return None  # (nan compares false with every start: it would empty the wave of every node)
        return _Answer("loading", node, began, None, tuple(claims(claimed)))

    # -- waves ------------------------------------------------------------------------------------------
    def in_wave(self, path: PurePath) -> bool:
        """Whether the file at `path` is split among nodes loading it (this one among them, or not)."""
        return bool(self._wave(path, False))

    def generation(self) -> int:
        """Counts the times a wave lost a node (its segments then owned by the others)."""
        return self._generation

    def _wave(self, path: PurePath, surely: bool) -> dict[str, Peer | None]:
        """The live nodes of the file's wave; `surely`: with the seeders that may still join it."""
        known = self.known(path)
        with self._lock:
            nodes = known.wave(self.node, lambda p: self._state[p].alive)
            if surely and known.joining(time.time()):
                nodes.update({n: p for p, n in known.idle.items() if n and self._state[p].alive})
        return nodes

    def mine(self, path: PurePath, start: int, surely: bool) -> bool:
        """Whether this node owns the segment at `start` of `path` (`surely`: would own it were every seeder
        that may still join the wave to join)."""
        nodes = self._wave(path, surely)
        return self.node in nodes and self.known(path).owner(nodes, self._tags[path], start) == self.node

    def asked(self, path: PurePath, start: int) -> bool:
        """Whether a node of the wave may ask this one for the segment at `start`: this node owns it, by what it
        knows of the others' claims or by rendezvous alone (what a node that has not seen a claim goes by)."""
        nodes = self._wave(path, False)
        tag = self._tags[path]
        return self.node in nodes and (
            owner(nodes, tag, start) == self.node or self.known(path).owner(nodes, tag, start) == self.node
        )

    def owner(self, path: PurePath, start: int, tried: Collection[Peer], polls: float = 0.0) -> Peer | None:
        """The peer that owns the segment at `start` of `path` (not in `tried`: the rest own what it did),
        counted in once it has a request free; None where this node owns it, none does, or the owner had no
        request free within the timeout and a long poll (the segment is read here)."""
        while True:
            nodes = {n: p for n, p in self._wave(path, True).items() if p not in tried}
            name = self.known(path).owner(nodes, self._tags[path], start) or ""
            peer = nodes.get(name)
            if peer is not None and name not in self.known(path).members:
                # a seeder that may still join the wave would own it: read here, it would be read twice from the
                # source; so wait for its word (asked again meanwhile), at most until the wave's window closes
                if self._stopped:
                    return None
                time.sleep(REPROBE)
                continue
            if peer is None:
                return None
            if self._take(peer, polls):
                if name in self.known(path).members:
                    return peer
                self._release(peer)  # counted out of the file's wave while this request waited (its 404)
            elif self._stopped or self._state[peer].alive:
                return None
            tried = [*tried, peer]  # dropped, or counted out, while this request waited: its segments are the others'

    def _release(self, peer: Peer) -> None:
        with self._lock:
            self._state[peer].inflight -= 1
            self._lock.notify_all()

    def _take(self, peer: Peer, polls: float) -> bool:
        """A request to `peer` counted in, once it has one free; False where it was dropped, the load
        stopped, or none came free within the timeout and a long poll (`polls` s, else `wave_wait()`'s: its
        requests may all wait that long there)."""
        deadline = time.monotonic() + self.timeout + max(polls, wave_wait())
        with self._lock:
            state = self._state[peer]
            while state.alive and not self._stopped:
                now = time.monotonic()
                if state.inflight < REQUESTS and state.busy_until <= now:
                    state.inflight += 1
                    return True
                if now >= deadline:
                    return False
                self._lock.wait(min(deadline, max(state.busy_until, now + 0.05)) - now)
        return False

    # -- requests ---------------------------------------------------------------------------------------
    def get(self, peer: Peer, path: PurePath, start: int, stop: int, source_rate: Callable[[], float | None],
            wait: float = 0.0) -> bytearray | None:  # fmt: skip
        """Bytes [start, stop) of `path` from `peer` (counted in by `choose` or `owner`); None where it failed
        (or is busy while another peer is free). `wait`: seconds a peer loading the file may wait for them to
        be verified (a long poll; such a request is given that much longer, and tells nothing of its rate)."""
        data = bytearray(stop - start)
        view = memoryview(data)

        def body(response: http.client.HTTPResponse, late: Callable[[], str | None]) -> None:
            got = 0
            while got < len(data):  # one receive at a time (read1): the watchdog's shut ends a slow one
                chunk = response.read1(min(len(data) - got, 1 << 20))
                if not chunk:
                    over = late()
                    raise _Failed(f"sent {got} of {len(data)} bytes in {over}" if over else
                                  f"ended its answer after {got} of {len(data)} bytes", late=bool(over))  # fmt: skip
                view[got : got + len(chunk)] = chunk
                got += len(chunk)

        source = source_rate() or SOURCE_RATE
        sooner = SOONER + len(data) / source + wait  # past it, the source would have sent the range: it is slower
        try:
            while True:
                began = time.monotonic()
                try:
                    self._request(peer, "GET", path, (start, stop), body, sooner, wait)
                    break
                except _Busy as exc:
                    if not self._on_busy(peer, path, exc, wait=True):
                        return None
                except _Failed as exc:
                    if exc.late and not wait and sooner < self.timeout + len(data) / FLOOR_RATE:
                        exc = _Failed(f"is slower than the source ({exc}; the source sends {len(data)} bytes in "
                                      f"about {len(data) / source:.2g} s)")  # fmt: skip
                    self._failed(peer, path, exc)
                    return None
        finally:
            self._release(peer)
        took = time.monotonic() - began
        state = self._state[peer]
        with self._lock:
            state.busy_since = None  # it answered as asked
            state.sent += len(data)
            if len(data) >= MEASURED and took > 0 and not wait:
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
        span: tuple[int, int] | None = None,
        body: Callable[[http.client.HTTPResponse, Callable[[], str | None]], None] | None = None,
        sooner: float | None = None,
        wait: float = 0.0,
    ) -> tuple[str | None, str | None, str | None]:
        """One request to `peer`, its answer checked to be the version and range asked for, then its body read
        by `body` (told how long the request was given, where its deadline cut it); raises _Failed for whatever
        went wrong (said in a line: whatever a peer makes a request raise drops it, never fails the load). The
        whole request, from the connect to the body's last byte, ends by its deadline: the timeout and a second
        per MB asked for (and `wait`, the long poll it allows), or `sooner` seconds where less. A kept connection
        the peer closed meanwhile (its idle timeout) is replaced once, at no cost. Returns the node the answer
        names, what it said of its copy and what of it the node has verified or reads (`storage/verified.py`:
        NODE, COPY, CLAIMED)."""
        target = peer.base + url_path(path)
        headers = {"If-Match": self._tags[path]}
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        if wait:
            headers[WAIT] = f"{wait:.3g}"
        limit = self.timeout + (span[1] - span[0] if span is not None else 0) / FLOOR_RATE + wait
        limit = limit if sooner is None else min(limit, sooner)
        for fresh in (False, True):
            connection, reused = self._connection(peer, fresh)
            connection.allow(wait)
            keep: Peer | None = None
            # a fresh nonce each time: a seeder refuses a proof it has seen (a replay)
            headers[peer_proof.HEADER] = peer_proof.proof(self._keys[path], method, target, headers.get("Range", ""))
            self._watchdog.arm(connection, time.monotonic() + limit)
            try:
                try:
                    connection.request(method, target, headers=headers)
                    response = connection.getresponse()
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                    if reused and not connection.expired:
                        continue  # closed by the peer while kept: once more, on a new connection
                    raise
                self._answer(method, path, span, response, wait)
                if body is not None:
                    body(response, partial(_late, connection, limit))
                if response.length == 0:
                    response.read()  # nothing is left (read to its end): its connection can take the next request
                keep = peer if response.isclosed() and not response.will_close else None
                return response.getheader(NODE), response.getheader(COPY), response.getheader(CLAIMED)
            except _Failed:
                raise
            except Exception as exc:  # MemoryError, ValueError, http.client's, ssl's...: the peer's doing
                raise self._named(exc, connection, limit) from None
            finally:
                self._watchdog.disarm(connection)
                self._let_go(connection, None if connection.expired else keep)

    def _answer(
        self, method: str, path: PurePath, span: tuple[int, int] | None, response: http.client.HTTPResponse,
        wait: float = 0.0,
    ) -> None:  # fmt: skip
        """Check that `response` is the version and range asked for (else raise _Failed). Any other answer's
        body is never read (its connection is closed): a peer cannot stall a load with one."""
        tag, size, status, reason = self._tags[path], self._sizes[path], response.status, _line(response.reason)
        if status == 404 and wait and span is not None:  # a node loading the file had not verified these bytes
            raise _Failed(f"had not verified bytes {span[0]}..{span[1]} of {path.name} in time (404)", drop=False)
        if status == 404:
            raise _Failed(f"does not hold {path.name} (404)", drop=False, node=_line(response.getheader(NODE) or ""))
        if status == 412:
            raise _Failed(f"holds another version of {path.name} than the source's (412)", drop=False)
        if status == 403:
            raise _Failed(f"refused us ({status} {reason}) when asked for {path.name}", drop=False, refused=True)
        if status == 503:
            raise _Busy(f"answered {status} {reason}", _retry_after(response.getheader("Retry-After")))
        want, length = (206, span[1] - span[0]) if span is not None else (200, size)
        if status != want:
            raise _Failed(f"answered {status} {reason} to a {method}")
        if response.chunked or response.getheader("Transfer-Encoding") is not None:
            raise _Failed(f"answered with a chunked body (Transfer-Encoding: "
                          f"{_line(response.getheader('Transfer-Encoding'))}), not {length} bytes")  # fmt: skip
        got = {"ETag": response.getheader("ETag"), "Content-Length": response.getheader("Content-Length")}
        expect = {"ETag": tag, "Content-Length": str(length)}
        if span is not None:
            got["Content-Range"] = response.getheader("Content-Range")
            expect["Content-Range"] = f"bytes {span[0]}-{span[1] - 1}/{size}"
        if got != expect:
            wrong = next(k for k in expect if got[k] != expect[k])
            raise _Failed(f"answered {wrong} {_line(got[wrong])!r}, not {expect[wrong]!r}")

    def _named(self, exc: BaseException, connection: _Connection, limit: float) -> _Failed:
        """A request's exception as why the peer failed."""
        if connection.expired:
            return _Failed(f"did not answer within {limit:.3g} s", late=True)
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            return _Failed(f"did not answer within {self.timeout:.3g} s")
        if isinstance(exc, ConnectionRefusedError):
            return _Failed(f"failed: {type(exc).__name__}: {_line(exc)}", unbound=True)
        if isinstance(exc, ssl.SSLCertVerificationError):
            return _Failed(f"has a certificate that does not verify ({_line(exc.verify_message or exc)}; checked "
                           f"against {self._trusts})")  # fmt: skip
        return _Failed(f"failed: {type(exc).__name__}: {_line(exc) or 'connection closed'}")

    def _connection(self, peer: Peer, fresh: bool) -> tuple[_Connection, bool]:
        """A connection to `peer` (a kept one unless `fresh`), and whether it was kept."""
        with self._lock:
            if self._stopped:
                raise _Failed("the load was stopped", drop=False)
            idle = self._state[peer].idle
            reused = bool(idle) and not fresh
            connection = idle.pop() if reused else _Connection(peer, self.timeout, self._tls)
            self._busy.add(connection)
        return connection, reused

    def _let_go(self, connection: _Connection, keep: Peer | None) -> None:
        """A request's connection: kept for `keep`'s next request where its answer was read whole, else closed."""
        with self._lock:
            self._busy.discard(connection)
            if keep is not None and self._state[keep].alive and not self._stopped:
                self._state[keep].idle.append(connection)
                return
        connection.close()

    # -- failures ---------------------------------------------------------------------------------------
    def _on_busy(self, peer: Peer, path: PurePath, exc: _Busy, wait: bool) -> bool:
        """`peer` answered 503: not chosen before its Retry-After (`exc.wait`), dropped once it has answered
        nothing else for `busy_limit` s. With `wait`: whether to ask it again now, after waiting for it where
        no other peer holding `path` is free (else: leave the range to another). Without: whether it is
        still a peer."""
        now = time.monotonic()
        with self._lock:
            state = self._state[peer]
            since = state.busy_since = now if state.busy_since is None else state.busy_since
            state.busy_until = max(state.busy_until, now + exc.wait)
        if now - since >= self.busy_limit:
            self.drop(peer, f"{exc} to every request for {now - since:.0f} s (asked for {path.name})")
            return False
        if not wait:
            return True
        with self._lock:
            known = self._known.get(path)
            others = [p for p in (known.holders if known else ()) if p != peer and self._state[p].alive
                      and self._state[p].inflight < REQUESTS and self._state[p].busy_until <= now]  # fmt: skip
            while not others and not self._stopped and state.alive and state.busy_until > time.monotonic():
                self._lock.wait(state.busy_until - time.monotonic())
            return not others and not self._stopped and state.alive

    def _failed(self, peer: Peer, path: PurePath, exc: _Failed) -> None:
        if self._stopped:
            return
        if exc.drop:
            self.drop(peer, f"{exc} (asked for {path.name})")
            return
        with self._lock:
            known = self._known.get(path)
            if known is not None:  # new lists: `holders` handed the old ones out
                known.holders = [p for p in known.holders if p != peer]
                known.members = {n: m for n, m in known.members.items() if m.peer != peer}
                known.idle = {p: n for p, n in known.idle.items() if p != peer}
                self._generation += 1
            kind = "refused" if exc.refused else "lacks"
            first = kind not in self._state[peer].warned
            self._state[peer].warned.add(kind)
        hint = "; a seeder refuses proofs of reading made with another token (or a clock minutes apart): set the "
        hint += f"same {settings.PEER_TOKEN.name} (or {settings.PEER_TOKEN_FILE.name}) on every node"
        (log.warning if first else log.debug)(
            "streamload: peer %s %s: not asked for it again this load (the other peers and the source serve it)%s",
            peer.name, exc, hint if exc.refused else "",
        )  # fmt: skip

    def drop(self, peer: Peer, why: str) -> None:
        """`peer` asked no more this load; one warning naming it."""
        with self._lock:
            state = self._state[peer]
            if not state.alive:
                return
            state.alive = False
            idle, state.idle = state.idle, []
            self._generation += 1
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
            connection.expire()

    _NOT_UP = "failed: nothing listened there (connection refused) while nodes joined the wave"

    def _listens(self, peer: Peer) -> bool:
        try:
            socket.create_connection((peer.host, peer.port), timeout=min(self.timeout, 1.0)).close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        with self._lock:  # a peer not up yet when the load ends (within a wave's window) is said once too,
            unbound = list({p for k in self._known.values() for p, node in k.idle.items() if not node})
        if unbound:  # unless it is up by now (asked last before the load read its last): asked at once, briefly
            for peer, up in zip(unbound, self._pool.map(self._listens, unbound), strict=True):
                if not up:
                    self.drop(peer, self._NOT_UP)
        self.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._watchdog.close()
        for state in self._state.values():  # stopped: no request keeps a connection any more
            idle, state.idle = state.idle, []
            for connection in idle:
                connection.close()


__all__ = ["DEFAULT_PORT", "PREFIX", "TALLY", "UNVERIFIED", "Peer", "PeerFiles", "PeerStorage", "Swarm", "names",
           "resolve", "url_path", "version_tag", "with_peers"]  # fmt: skip
