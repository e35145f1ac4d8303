"""Nodes that start together split a file (docs/peers.md#nodes-that-start-together): each segment of checked
units has one owner among the nodes loading it, by rendezvous hashing; the owner reads it from the source,
ahead of its own pipeline (`Ahead`), checks it and marks it verified, and the others ask it for it. What
the wave's members are, and how the segments are asked for, is peers.py's (Swarm, PeerFiles).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Generic, TypeVar

from streamload.integrity.blocks import Units
from streamload.storage.verified import Verified

log = logging.getLogger("streamload")
TOGETHER = 10.0  # seconds: nodes whose copies of a file began within this of the first one's split it
REPROBE = 0.02  # seconds before seeders that lack a file yet are asked again (while nodes may join its wave)
REPROBE_MOST = 1.0  # the wait doubles each time, to this
IDLE = 0.25  # seconds a fetcher with nothing to read waits before it looks again (unless told of a change)
AHEAD = 2  # threads a load reads the segments it owns with, ahead of its pipeline
WANTED = 64  # segments of one range a peer waits for that the fetcher looks at (a peer asks for one)

P = TypeVar("P", bound=Hashable)
Segment = tuple[int, int, int, int]  # [start, end) and units i..j-1 (i == j: bytes no unit covers)


def rank(node: str, tag: str, start: int) -> int:
    """The rendezvous weight of `node` for the segment at `start` of the file version `tag`."""
    return int.from_bytes(hashlib.blake2b(f"{node}\n{tag}\n{start}".encode(), digest_size=8).digest(), "big")


def owner(nodes: Iterable[str], tag: str, start: int) -> str | None:
    """The node that owns the segment at `start` among `nodes` (the same on every node that sees them)."""
    return max(nodes, key=lambda n: rank(n, tag, start), default=None)


@dataclass(frozen=True)
class Member(Generic[P]):
    """A node loading a file with this one, as its HEAD answer said: a peer of this load to ask, when its copy
    began, and what of it the node had verified or was reading then (verified.CLAIMED)."""

    peer: P
    since: float
    claims: tuple[tuple[int, int], ...]


@dataclass
class Known(Generic[P]):
    """What one load learnt of one file from its peers' HEAD answers (`P`: how it names a peer)."""

    holders: list[P] = field(default_factory=list)  # complete copies
    members: dict[str, Member[P]] = field(default_factory=dict)  # nodes loading it, by node id
    idle: dict[P, str] = field(default_factory=dict)  # seeders (their nodes) without it yet, while nodes may join
    since: float | None = None  # this node's copy began then, where its own seeder serves it (one of the wave)
    asked: float = 0.0  # when the idle seeders were last asked (monotonic)
    every: float = REPROBE  # seconds until they are asked again
    asking: bool = False  # a thread asks them now

    def wave(self, me: str | None, alive: Callable[[P], bool]) -> dict[str, P | None]:
        """The live nodes that split the file (None: this one): those whose copies began within `TOGETHER` s of
        the first live one's. A node that began later reads from them and owns nothing, as they count it out too."""
        members = self.members  # (replaced whole, never changed: read without a lock)
        began = {node: m.since for node, m in members.items() if alive(m.peer)}
        if me is not None and self.since is not None:
            began[me] = self.since
        first = min(began.values(), default=0.0)
        return {n: (None if n == me else members[n].peer) for n, at in began.items() if at <= first + TOGETHER}

    def owner(self, nodes: Iterable[str], tag: str, start: int) -> str | None:
        """The node of `nodes` that owns the segment at `start`: a member that said it had verified or was
        reading it when asked (the earliest to begin: a node that joins late takes nothing already under way),
        else by rendezvous."""
        nodes = list(nodes)
        members = self.members
        claimed = [n for n in nodes if n in members and any(a <= start < b for a, b in members[n].claims)]
        if claimed:
            return min(claimed, key=lambda n: (members[n].since, n))
        return owner(nodes, tag, start)

    def joining(self, now: float) -> bool:
        """Whether nodes may still join the wave (the first copy began less than `TOGETHER` s ago)."""
        began = [m.since for m in self.members.values()] + ([self.since] if self.since is not None else [])
        return bool(began) and now <= min(began) + TOGETHER


class Segments:
    """A file's checked units cut into segments once (`Units.segments` over all of them), so that every node
    and every read names the same segments, whatever ranges its plan reads."""

    def __init__(self, units: Units) -> None:
        first, last = (units.units[0].start, units.units[-1].end) if units.units else (0, 0)
        self.all = units.segments(first, last) if units.units else []
        self.starts = [s[0] for s in self.all]
        self.begin, self.end = first, last

    def over(self, lo: int, hi: int) -> list[Segment]:
        """The segments [lo, hi) touches, whole, in order; bytes outside every unit as (a, b, 0, 0)."""
        out: list[Segment] = [(lo, min(hi, self.begin), 0, 0)] if lo < self.begin else []
        k = max(0, bisect_right(self.starts, lo) - 1)
        while k < len(self.all) and self.all[k][0] < hi:
            if self.all[k][1] > lo:
                out.append(self.all[k])
            k += 1
        if hi > self.end:
            out.append((max(lo, self.end), hi, 0, 0))
        return out


class Slots:
    """The segments being read by one thread of a load: another thread that needs one waits for it."""

    def __init__(self) -> None:
        self._reading: dict[tuple[PurePath, int], threading.Event] = {}
        self._lock = threading.Lock()

    def take(self, path: PurePath, start: int) -> threading.Event | None:
        """None where this thread takes the segment (`done` lets it go); else the event its reader sets."""
        with self._lock:
            busy = self._reading.get((path, start))
            if busy is None:
                self._reading[(path, start)] = threading.Event()
            return busy

    def done(self, path: PurePath, start: int) -> None:
        with self._lock:
            self._reading.pop((path, start)).set()


class Ahead:
    """Reads the segments this node owns from the source ahead of its pipeline (threads of their own, in
    file order; a segment a peer waits for first), so that a node whose pipeline waits for others never
    keeps them waiting in turn. `mine(path, start, surely)`: whether this node owns the segment (`surely`:
    also were the seeders that may still join to join); `asked(path, start)`: whether a peer that waits for it
    may count on this node (it owns it by rendezvous: a peer that has not seen another's claim asks it here);
    `read(path, segment)`: fetch (from where this node thinks it is), check and keep it."""

    def __init__(
        self,
        files: list[tuple[PurePath, Segments, Verified]],
        mine: Callable[[PurePath, int, bool], bool],
        read: Callable[[PurePath, Segment], None],
        generation: Callable[[], int],
        asked: Callable[[PurePath, int], bool],
    ) -> None:
        self._files, self._mine, self._read, self._generation, self._asked = files, mine, read, generation, asked
        self._cursor = dict.fromkeys((path for path, _, _ in files), 0)
        self._seen = generation()
        self._failed: set[tuple[PurePath, int]] = set()
        self._taken: set[tuple[PurePath, int]] = set()  # being read by one of these threads
        self._lock = threading.Lock()
        self._poke = threading.Event()
        self._stop = threading.Event()
        for _, _, verified in files:
            verified.listen(self._poke.set)
        self._threads = [threading.Thread(target=self._run, name="streamload-peers-ahead", daemon=True)
                         for _ in range(AHEAD)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            task = self._next()
            if task is None:
                self._poke.wait(IDLE)  # a peer asking, a copy ending, or the wave changing
                self._poke.clear()
                continue
            path, segment = task
            try:
                self._read(path, segment)
            except Exception as exc:  # the store failed it: the pipeline reads it itself, and says so
                log.debug("streamload: peers: reading %s bytes %d.. ahead failed: %s", path.name, segment[0], exc)
                with self._lock:
                    self._failed.add((path, segment[0]))
            finally:
                with self._lock:
                    self._taken.discard((path, segment[0]))

    def _next(self) -> tuple[PurePath, Segment] | None:
        """The next segment to read: one a peer waits for that this node owns, else the next it owns."""
        with self._lock:
            if self._generation() != self._seen:  # a node left the wave: its segments may be this one's now
                self._seen = self._generation()
                self._cursor = dict.fromkeys(self._cursor, 0)
            for path, segments, verified in self._files:
                for lo, hi in verified.wanted():
                    for s in segments.over(lo, hi)[:WANTED]:
                        if self._due(path, s, verified) and self._asked(path, s[0]):
                            self._taken.add((path, s[0]))
                            return path, s
            for path, segments, verified in self._files:
                k = self._cursor[path]
                while k < len(segments.all) and not self._stop.is_set():
                    s = segments.all[k]
                    k += 1
                    if self._due(path, s, verified) and self._mine(path, s[0], True):
                        self._cursor[path] = k
                        self._taken.add((path, s[0]))
                        return path, s
                self._cursor[path] = k
        return None

    def _due(self, path: PurePath, segment: Segment, verified: Verified) -> bool:
        start, end, i, j = segment
        done = verified.ended or verified.covers(start, end)
        return i < j and not done and (path, start) not in self._failed and (path, start) not in self._taken

    def close(self) -> None:
        self._stop.set()
        self._poke.set()
        for thread in self._threads:
            thread.join()
        for _, _, verified in self._files:
            verified.listen(self._poke.set, add=False)


__all__ = ["AHEAD", "IDLE", "REPROBE", "REPROBE_MOST", "TOGETHER", "Ahead", "Known", "Member", "Segment", "Segments",
           "Slots", "owner", "rank"]  # fmt: skip
