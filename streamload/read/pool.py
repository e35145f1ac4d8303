"""A stream's use of the process-wide reader threads (see limits.py).

A batch's jobs are handed over together, so waiting for a batch costs the event loop one thread hop
however many requests it takes, and jobs run in the order batches were planned. A stream has at most
`threads` requests with the shared pool at once, so one large load cannot queue so far ahead that
the others wait behind all of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait

from anyio import to_thread

from ..limits import shared_limits
from .base import Done, Job


class ReaderPool:
    def __init__(self, threads: int, on_bytes: Callable[[int], None]) -> None:
        self._limits = shared_limits()
        self._executor = self._limits.join()
        self._turns = threading.Semaphore(threads)  # this stream's requests queued or running
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._on_bytes = on_bytes
        self._pending: set[Future[None]] = set()
        self._closed = False

    def run(self, jobs: Sequence[Job]) -> None:
        """Run `jobs` in parallel and return when every one has finished (blocking).

        Raises the first job's error, but only once none of them can still write into the slot.
        """
        futures = []
        for job in jobs:
            self._turns.acquire()
            future = self._executor.submit(self._one, job)
            with self._lock:
                self._pending.add(future)
            future.add_done_callback(self._finished)
            futures.append(future)
        wait(futures)
        for f in futures:
            f.result()

    async def run_async(self, jobs: Sequence[Job]) -> None:
        """`run` from async code: jobs that have nothing left to read finish inline, without a thread."""
        if all(isinstance(j, Done) for j in jobs):
            for j in jobs:
                self._on_bytes(j())
        else:
            await to_thread.run_sync(self.run, jobs)

    def _one(self, job: Job) -> None:
        if self._stop.is_set():  # the stream is ending: requests not yet begun are skipped
            return
        try:
            n = job()
        except BaseException:
            self._stop.set()
            raise
        with self._lock:
            self._on_bytes(n)

    def _finished(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)
        self._turns.release()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Skip what has not begun, wait for what has (it may write into a slot), leave the pool."""
        self._stop.set()
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        if not self._closed:
            self._closed = True
            self._limits.leave()
