"""What this process has verified of the copies it is still writing, and which node it is: what lets its
seeder (servers/seed.py) serve a copy while the load writing it runs (docs/peers.md#nodes-that-start-together).

A load's cache writer (storage/cache.py) registers each copy it writes here (`Verified`, by the copy's folder
and name, as the seeder finds them walking the cache) and marks the ranges that passed the integrity layer
(integrity/blocks.py): a peer's blocks once settled, the origin's once checked against the same digests. Only
those ranges are ever served from a copy in progress; a range not yet verified is waited for, a bounded time.
A seeder names its node in every answer (`node_id`: one id a process and cache directory), so that a load
that finds its own seeder among its peers knows itself in the wave.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from streamload.format.header import FileHeader

NODE = "X-Streamload-Node"  # every answer of a seeder: the node it serves for
COPY = "X-Streamload-Copy"  # a HEAD's answer: "complete", or "loading; since=<unix seconds>"
WAIT = "X-Streamload-Wait"  # a GET's: seconds it may wait for bytes its node is still verifying
# a HEAD's answer of a copy in progress: the ranges its node has verified or reads from the source now, "a-b,c-d"
# ([a, b)): a node that joins the wave later leaves them to it (they would be read from the source twice)
CLAIMED = "X-Streamload-Claimed"
OFFSET_DIGITS = 20  # a byte offset's decimal digits at most (2**64 has 20)
CLAIMS = 1024  # the most ranges said (merged: a copy's segments in a few runs, but a header stays bounded)
LONG_POLL = 30.0  # the most a seeder waits so (an owner reads its segment from a store that serves every
# node's first segments at once: seconds at 200 Mbit/s for 8 nodes; measured in bench/wave.py)


def claims(text: str | None) -> list[tuple[int, int]]:
    """The ranges a `CLAIMED` value says (merged; [] for anything else: a peer's word only steers who reads
    what from the source, never what is used)."""
    out = []
    for part in (text or "").split(",")[:CLAIMS]:
        a, _, b = part.strip().partition("-")
        # ASCII digits, an offset's length at most ("²".isdigit(); int() of 5000 digits raises)
        if not all(x.isascii() and x.isdecimal() and len(x) <= OFFSET_DIGITS for x in (a, b)) or int(a) >= int(b):
            return []
        out.append((int(a), int(b)))
    return merged(out)


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether merged `ranges` hold all of [start, end)."""
    return start >= end or any(a <= start and end <= b for a, b in ranges)


def gaps(written: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) outside `written` (merged, sorted ranges)."""
    out, at = [], lo
    for a, b in written:
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


class Verified:
    """The ranges of one copy in progress that this process verified, and the descriptor they can be read
    through (the writer's own file). Thread-safe; `listen` tells a waiter (a seeder's request, the load's
    fetcher) of every change: a range verified, one wanted by a peer, the copy ended."""

    def __init__(self, header: FileHeader, fd: int) -> None:
        self.header = header
        self.since = time.time()  # when this node began the copy: nodes that began together split it
        self._fd: int | None = fd
        self._ranges: list[tuple[int, int]] = []
        self._wanted: dict[tuple[int, int], int] = {}  # ranges peers wait for: how many wait for each
        self._reading: dict[tuple[int, int], int] = {}  # ranges this node reads from the source now
        self._listeners: set[Callable[[], None]] = set()
        self._lock = threading.Lock()

    def mark(self, start: int, end: int) -> None:
        with self._lock:
            self._ranges = merged([*self._ranges, (start, end)])
        self._tell()

    def covers(self, start: int, end: int) -> bool:
        with self._lock:
            return covered(self._ranges, start, end)

    def open(self) -> int | None:
        """A descriptor of the copy (a duplicate, the caller's to close); None once the writer ended it."""
        with self._lock:
            return None if self._fd is None else os.dup(self._fd)

    def end(self) -> None:
        """The writer is done with its file (completed, or dropped): no new descriptor of it is handed out."""
        with self._lock:
            self._fd = None
        self._tell()

    @property
    def ended(self) -> bool:
        return self._fd is None

    def want(self, start: int, end: int, add: bool = True) -> None:
        """A peer waits for [start, end) (or, `add` False, no longer does)."""
        with self._lock:
            _counted(self._wanted, (start, end), add)
        if add:
            self._tell()

    def wanted(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._wanted)

    def reading(self, start: int, end: int, add: bool = True) -> None:
        """This node reads [start, end) from the source now (or, `add` False, no longer does)."""
        with self._lock:
            _counted(self._reading, (start, end), add)

    def claimed(self) -> str:
        """The ranges verified or being read (`CLAIMED`'s value), the first `CLAIMS` of them."""
        with self._lock:
            ranges = merged([*self._ranges, *self._reading])
        return ",".join(f"{a}-{b}" for a, b in ranges[:CLAIMS])

    def listen(self, listener: Callable[[], None], add: bool = True) -> None:
        with self._lock:
            (self._listeners.add if add else self._listeners.discard)(listener)

    def _tell(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


def _counted(counts: dict[tuple[int, int], int], key: tuple[int, int], add: bool) -> None:
    """One more of `key` in `counts` (or, `add` False, one fewer: none left, no entry)."""
    n = counts.get(key, 0) + (1 if add else -1)
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


_loading: dict[tuple[int, int, str], Verified] = {}  # (folder's device, inode; name): the copy in progress there
_nodes: dict[tuple[int, int], str] = {}  # a cache directory (device, inode): this process's node id for it
_lock = threading.Lock()


def _folder(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def register(folder: int, name: str, verified: Verified) -> None:
    """The copy `name` in the open folder `folder` is being written by a load of this process."""
    with _lock:
        _loading[(*_folder(folder), name)] = verified


def unregister(folder: int, name: str, verified: Verified) -> None:
    with _lock, contextlib.suppress(OSError):
        key = (*_folder(folder), name)
        if _loading.get(key) is verified:
            del _loading[key]


def loading(folder: int, name: str) -> Verified | None:
    """The copy in progress that a load of this process writes as `name` in the open folder `folder`."""
    with _lock:
        return _loading.get((*_folder(folder), name))


def _identity(cache_dir: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(cache_dir)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def node_id(cache_dir: Path) -> str:
    """This process's node id for `cache_dir` (made by its first seeder: one a process and cache directory,
    whatever address it is reached at)."""
    key = _identity(cache_dir)
    with _lock:
        if key is None:
            return secrets.token_hex(8)
        return _nodes.setdefault(key, secrets.token_hex(8))


def node_of(cache_dir: Path | None) -> str | None:
    """The node id a seeder of this process serves `cache_dir` under; None where none does."""
    key = None if cache_dir is None else _identity(cache_dir)
    with _lock:
        return None if key is None else _nodes.get(key)


__all__ = ["CLAIMED", "COPY", "LONG_POLL", "NODE", "WAIT", "Verified", "claims", "covered", "gaps", "loading", "merged",
           "node_id", "node_of", "register", "unregister"]  # fmt: skip
