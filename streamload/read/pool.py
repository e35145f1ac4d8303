"""A stream's use of the process-wide reader threads (see base/limits.py).

`submit` never blocks: a batch's jobs queue here, in plan order, and go to the shared thread pool as
this stream's turns free up, so a stream has at most `threads` requests with the pool at once and one
large load cannot queue so far ahead that the others wait behind all of it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from streamload.base.limits import shared_limits
from streamload.read.base import Job, Work


class Reads:
    """The jobs of one batch: `wait` returns once every one has finished, or raises the first error
    (only once none of them can still write into the slot)."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._error: BaseException | None = None
        self._done = threading.Event()
        if count == 0:
            self._done.set()

    def _finished(self, error: BaseException | None) -> None:  # under the pool's lock
        if error is not None and self._error is None:
            self._error = error
        self._left -= 1
        if self._left == 0:
            self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class ReaderPool:
    def __init__(self, threads: int, on_bytes: Callable[[int], None]) -> None:
        self._limits = shared_limits()
        self._executor = self._limits.join()
        self._turns = threads  # requests this stream may still hand to the shared pool
        self._queue: deque[tuple[Job, Reads]] = deque()
        self._running = 0
        self._stop = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._on_bytes = on_bytes
        self._closed = False

    def submit(self, work: Sequence[Work]) -> Reads:
        """Queue a batch's jobs; they run in the order submitted. Bytes already in place (ints) are
        counted at once: a warm load that needs no request starts no thread."""
        jobs = [job for job in work if not isinstance(job, int)]
        done = sum(n for n in work if isinstance(n, int))
        reads = Reads(len(jobs))
        with self._lock:
            if done:
                self._on_bytes(done)
            self._queue.extend((job, reads) for job in jobs)
            self._pump()
        return reads

    def _pump(self) -> None:  # under the lock
        while self._queue and self._turns > 0:
            job, reads = self._queue.popleft()
            if self._stop:
                # The stream is ending or a request failed: requests not yet begun are skipped. The queue
                # is in plan order, so a failure skips only its own batch's later requests and later
                # batches': the consumer meets the failed batch first and never makes a skipped one.
                reads._finished(None)
                continue
            try:
                self._executor.submit(self._one, job, reads)
            except RuntimeError as exc:  # the interpreter is shutting down: no thread will run it
                self._stop = True
                reads._finished(exc)
                continue
            self._turns -= 1
            self._running += 1

    def _one(self, job: Job, reads: Reads) -> None:
        error: BaseException | None = None
        n = 0
        try:
            n = job()
        except BaseException as exc:
            error = exc
        with self._lock:
            if error is not None:
                self._stop = True  # the stream fails: later requests need not run
            else:
                self._on_bytes(n)
            reads._finished(error)
            self._turns += 1
            self._running -= 1
            self._pump()
            if self._running == 0:
                self._idle.notify_all()

    @property
    def idle(self) -> bool:
        """No request runs: none writes into a slot or uses a descriptor (after `stop`, none starts again)."""
        return self._running == 0

    def stop(self) -> None:
        """Skip every request not yet begun (their batches finish at once, unread)."""
        with self._lock:
            self._stop = True
            self._pump()

    def close(self) -> None:
        """Skip what has not begun, wait for what has (it may write into a slot), leave the pool."""
        with self._lock:
            self._stop = True
            self._pump()
            while self._running:
                self._idle.wait()
            if self._closed:
                return
            self._closed = True
        self._limits.leave()
