"""How many requests an object store gets at once, and how large each is: learnt from the requests.

A store behind a network answers each request after a first-byte latency `L` and then sends at up to a
per-connection rate `r` (S3: ~20-50 ms, tens of MB/s), while the link caps all connections together.
Both rules below follow from what this process's requests measured, neither is hand-set:

- request size: a request spends `L` waiting and `size / r` receiving, so `size >= 4 * L * r` keeps the
  wait under a fifth of it (a power of two, 256 KiB-16 MiB; 256 KiB until the first requests have answered).
- connections: as few as fill the link. Starting from 16, the count doubles while doubling it raised
  what all requests together received by 15% or more (requests were waiting for a connection,
  so more could run); when it did not, the count goes back to the smaller one and stays there for
  the load. Fewer connections on a link mean each request, and so each batch in plan order, arrives
  sooner: the first tensor is not slowed by the requests of the batches behind it.

One `Pace` per store (scheme://bucket or host) per process: a later load of the same store starts
from where the last one settled and checks it again (`restart`). Everything but `request_bytes`
runs on the requests' event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from typing import NamedTuple

log = logging.getLogger("streamload")
MiB = 1 << 20
SMALLEST, LARGEST = 256 << 10, 16 * MiB  # request sizes
FIRST_CONNECTIONS, MOST_CONNECTIONS = 16, 256
MEASURED = 256 << 10  # requests smaller than this say little about a connection's rate
WAIT_SHARE = 4  # a request receives for >= 4x its first-byte wait
GAIN = 1.15  # doubling the connections must raise the total rate this much to be kept


class Sample(NamedTuple):
    first_byte: float  # seconds until the response's headers
    body: float  # seconds receiving the body
    nbytes: int
    ticket: tuple[int, int]  # (the count's epoch, the request's number in it) when it began


class Pace:
    """The request size and connection count for one store, adapted as its requests complete."""

    def __init__(self, connections: int = FIRST_CONNECTIONS) -> None:
        self.limit = connections  # requests in flight at most
        self.latency: float | None = None  # median first-byte seconds
        self.rate: float | None = None  # bytes/s a request receives (median)
        self._size = SMALLEST
        self._active = 0
        self._area = 0.0  # integral of `_active` over time since the window began
        self._began = self._tick = time.perf_counter()
        self._waiting: deque[asyncio.Future[None]] = deque()
        self.level = 0  # bumped at each new window (`_change`): a sample tells which window it began in
        self._samples: list[Sample] = []  # of the first requests begun under the current count
        self._issued = 0  # requests begun under the current count
        self._before: tuple[int, float] | None = None  # (count, total rate) of the last count tried
        self._settled = False
        self._halved = 0  # the level the count was last halved at (`refused`)

    def restart(self) -> None:
        """A new load: check the count again (the store, or its link's load, may have changed)."""
        self._settled, self._before = False, None
        self._change(self.limit)

    def request_bytes(self) -> int:
        """The size to cut a read into (any thread)."""
        return self._size

    async def acquire(self, measured: bool = True) -> tuple[int, int]:
        """Wait for a connection (in the order asked: earlier reads are earlier in the plan); returns
        the request's ticket, for `record` (`measured`: a data read, whose timing decides the count;
        headers and listings are not)."""
        if self._active >= self.limit or self._waiting:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter  # `release` counted this request in already
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.release()  # given a connection just as it was cancelled: pass it on
                elif waiter in self._waiting:  # (`_wake` drops waiters cancelled before their turn)
                    self._waiting.remove(waiter)
                raise
        else:
            self._count(+1)
        if not measured:
            return self.level, -1  # never part of a cohort
        self._issued += 1
        return self.level, self._issued - 1

    def release(self) -> None:
        self._count(-1)
        self._wake()

    def refused(self, ticket: tuple[int, int]) -> bool:
        """The store refused or dropped a request's connection before answering (it caps connections:
        nginx's `worker_connections`, a proxy's limit): half as many requests at once, kept for the load,
        as object-store clients back off. True where the request may be tried again at no cost to its
        attempts: the count was halved now, or already since it began; False at one request at once."""
        if ticket[0] < self._halved:
            return True
        if self.limit <= 1:
            return False
        log.info("streamload: the store refused connections: %d requests at once, not %d", self.limit // 2, self.limit)
        self._settled, self._before = True, None
        self._change(self.limit // 2)
        self._halved = self.level
        return True

    def _count(self, change: int) -> None:
        now = time.perf_counter()
        self._area += self._active * (now - self._tick)
        self._tick, self._active = now, self._active + change

    def _wake(self) -> None:
        while self._waiting and self._active < self.limit:
            waiter = self._waiting.popleft()
            if not waiter.done():
                self._count(+1)
                waiter.set_result(None)

    def _change(self, limit: int) -> None:
        if limit != self.limit:
            log.debug("streamload: %d requests at once (latency %s s, %s B/s each)", limit, self.latency, self.rate)
        self.limit, self.level = limit, self.level + 1
        self._samples, self._issued = [], 0
        self._wake()
        self._count(0)
        self._area, self._began = 0.0, self._tick

    def record(self, sample: Sample) -> None:
        """A request's timing. Once the first `limit` requests begun under the current count (at least
        4) have all answered, the size and the count are decided: all of them, so that the slow ones
        weigh in as much as the fast (the first to answer are the fastest)."""
        level, number = sample.ticket
        cohort = max(4, self.limit)
        if level != self.level or not 0 <= number < cohort:
            if self._issued > 4 * cohort:  # a request of the cohort failed: it will not answer
                self._change(self.limit)
            return
        self._samples.append(sample)
        if len(self._samples) < cohort:
            return
        window = self._samples
        self.latency = statistics.median(s.first_byte for s in window)
        rates = [s.nbytes / s.body for s in window if s.nbytes >= MEASURED and s.body > 0]
        if rates:
            self.rate = statistics.median(rates)
            self._size = _request_size(self.latency, self.rate)
        # What the requests received together: as many in flight as there were on average, each at
        # what a request of the cohort received per second of its life (from asking to its last byte).
        self._count(0)
        busy = self._area / max(1e-9, self._tick - self._began)
        total = busy * sum(s.nbytes for s in window) / max(1e-9, sum(s.first_byte + s.body for s in window))
        if self._settled or busy < 0.75 * self.limit or len(rates) < len(window) // 2:
            # Settled, or the reads kept fewer requests in flight than the count (it was not what
            # limited them), or small requests only: nothing to learn about the count. Measure afresh.
            self._change(self.limit)
            return
        before = self._before
        log.debug("streamload: pace: %d requests at once receive %.1f MB/s together", self.limit, total / 1e6)
        if before is not None and total < GAIN * before[1]:
            self._settled = True  # the last doubling did not pay: back to the count before it
            self._change(before[0])
            return
        self._before = (self.limit, total)
        if self.limit >= MOST_CONNECTIONS:
            self._settled = True
            self._change(self.limit)
        else:
            self._change(min(MOST_CONNECTIONS, 2 * self.limit))


def _request_size(latency: float, rate: float) -> int:
    want = WAIT_SHARE * latency * rate
    size = SMALLEST
    while size < want and size < LARGEST:
        size *= 2
    return size


class Timer:
    """Times one request: `headers()` when its response began, `sample(n, ticket)` once its body is in."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first = self.start

    def headers(self) -> None:
        self.first = time.perf_counter()

    def sample(self, nbytes: int, ticket: tuple[int, int]) -> Sample:
        now = time.perf_counter()
        return Sample(self.first - self.start, now - self.first, nbytes, ticket)


_PACES: dict[str, Pace] = {}


def restart_all() -> None:
    """Every store's `Pace` as new, in place (a forked child: what its parent had in flight is not its own;
    a storage made before the fork holds the same object)."""
    for pace in _PACES.values():
        pace.__init__(pace.limit)  # type: ignore[misc]


def pace_of(root: str) -> Pace:
    """The process's `Pace` for the store at `root` (made on first use, on the loop thread or not)."""
    return _PACES.setdefault(root, Pace())
