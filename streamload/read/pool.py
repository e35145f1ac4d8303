"""Reader threads. A batch's jobs are handed over together, so waiting for a batch costs the event
loop one thread hop however many requests it takes, and jobs run in the order batches were planned."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from anyio import to_thread

from .base import Done, Job


class ReaderPool:
    def __init__(self, threads: int, on_bytes: Callable[[int], None]) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="streamload-read")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._on_bytes = on_bytes

    def run(self, jobs: Sequence[Job]) -> None:
        """Run `jobs` in parallel and return when every one has finished (blocking).

        Raises the first job's error, but only once none of them can still write into the slot.
        """
        futures = [self._pool.submit(self._one, job) for job in jobs]
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

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)
