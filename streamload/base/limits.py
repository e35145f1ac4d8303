"""Process-wide limits: one pool of reader threads and one budget of staging memory for every stream,
and the host staging slots the process keeps between streams.

A server that loads many checkpoints at once (adapters, several models) must not grow threads and
staging with the number of loads: every stream borrows reader threads from one pool and takes its ring
slots from one budget (it waits for its first slot, takes more only while the budget allows, and gives
them all back when it ends), so all streams together stay within the cap and each still makes progress.

One exception keeps a first slot from waiting for ever. A stream gives staging back only as its
consumer reads on: the async task that opened it (its calls run on worker threads, but the task waits
for each), else the thread that took its first slot. When every stream holding staging belongs to a
consumer itself waiting for a first slot (`zip(iter(a), iter(b))`: the thread waiting for `b`'s is the
only reader of `a`; or two threads, each holding a stream and waiting for a second), the waiting stream
takes its first slot beyond the cap: by at most that slot (with the device's buffers) for each stream
started so (`usage().staging_over`); every other slot waits until the total is within the cap again.
(A stream opened outside the task that reads it with `async for` counts as the worker thread's that
took its first slot: open streams read in turn by one task inside that task.)
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from streamload.base import argument_checks, tuning


class Usage(NamedTuple):
    """A snapshot of the process-wide limits and what the streams use of them."""

    reader_threads: int  # the pool's size
    staging_cap: int  # bytes
    staging_bytes: int  # bytes of staging held by running streams now
    staging_peak: int  # the most held at once since the process started (or the last reset)
    streams: int  # streams using the reader pool now
    staging_kept: int = 0  # bytes of host slots kept for later streams (within the cap, with what is held)
    staging_over: int = 0  # bytes of first slots held beyond the cap by running streams (see the module's doc)
    staging_waiting: int = 0  # streams waiting for their first slot now


Register = Callable[[torch.Tensor], "Callable[[], None] | None"]
_PAGE = mmap.PAGESIZE


class HostSlots:
    """Host staging slots, kept by the process across streams (within the staging cap).

    Pinned memory costs its page faults, not the pinning (measured on an H100 machine: 256 MiB took
    164 ms with `pin_memory=True` and 168 ms to register fresh pages, 14 ms pages already touched). So a
    slot is plain anonymous memory (page-aligned, as O_DIRECT needs) whose pages the reader threads fault
    in as they read; a device that copies from it `pin`s it once filled (registered with CUDA on first
    use only); and a closed stream's slots go to the next stream, not back to the system."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}  # by size
        self.kept = 0  # bytes in `_free`
        self._pinned: dict[int, tuple[int, Callable[[], None]]] = {}  # data_ptr -> (bytes registered, undo)
        self._refused: set[int] = set()  # slots CUDA would not register

    def take(self, nbytes: int) -> torch.Tensor:
        """A slot of `nbytes`: one a closed stream left (its pages in, maybe pinned), else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.kept -= nbytes
                return free.pop()
        memory = mmap.mmap(-1, nbytes)  # pages come on first write
        slot = torch.frombuffer(memory, dtype=torch.uint8)
        # A slot dropped any other way than through `give` (an error while a stream closed) must not
        # stay registered, nor leave its address looking registered to a later slot mapped there.
        weakref.finalize(memory, self._forget, slot.data_ptr()).atexit = False
        return slot

    def _forget(self, ptr: int) -> None:
        with self._lock:
            pinned = self._pinned.pop(ptr, None)
            self._refused.discard(ptr)
        if pinned is not None:
            pinned[1]()

    def give(self, slots: list[torch.Tensor], keep: int) -> None:
        """Return slots for later streams, keeping at most `keep` bytes in all."""
        with self._lock:
            for slot in slots:
                self._free.setdefault(slot.numel(), []).append(slot)
                self.kept += slot.numel()
        self.trim(keep)

    def trim(self, keep: int) -> None:
        """Drop kept slots beyond `keep` bytes (0: all of them)."""
        dropped = []
        with self._lock:
            for size in sorted(self._free, reverse=True):
                free = self._free[size]
                while free and self.kept > keep:
                    dropped.append(free.pop())
                    self.kept -= size
            self._free = {size: free for size, free in self._free.items() if free}
        for slot in dropped:  # unregistered before it is unmapped: a later slot may reuse the address
            self._forget(slot.data_ptr())

    def pin(self, slot: torch.Tensor, register: Register, used: int | None = None) -> bool:
        """Register the first `used` bytes of `slot` (whole pages; all of it if None) unless they are
        already: `register` returns how to undo it, or None if CUDA refused, and a refused slot is
        not asked again (it is copied from pageable memory). A later batch that uses more bytes than
        were registered registers the whole slot instead."""
        ptr = slot.data_ptr()
        want = slot.numel() if used is None else min(slot.numel(), -(-used // _PAGE) * _PAGE)
        with self._lock:
            if ptr in self._refused:
                return False
            pinned = self._pinned.pop(ptr, None)
        if pinned is not None:
            if pinned[0] >= want:
                with self._lock:
                    self._pinned[ptr] = pinned
                return True
            pinned[1]()  # too few bytes: unregister, then register the whole slot
            want = slot.numel()
        unpin = register(slot[:want])
        with self._lock:
            if unpin is None:
                self._refused.add(ptr)
                return False
            self._pinned[ptr] = (want, unpin)
        return True


class _Limits:
    def __init__(self, reader_threads: int, staging_bytes: int) -> None:
        self.reader_threads = reader_threads
        self.staging_cap = staging_bytes
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # staging was given back
        self._held = 0
        self._peak = 0
        self._over = 0  # first slots given beyond the cap, to streams still holding them
        self._holders: dict[object, int] = {}  # consumer -> its streams holding staging
        self._waiting: dict[object, int] = {}  # consumer -> its streams waiting for a first slot
        self._executor: ThreadPoolExecutor | None = None
        self._users = 0
        self.host = HostSlots()

    # -- reader threads: one executor while any stream runs, shut down with the last one ---------------
    def join(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.reader_threads, thread_name_prefix="streamload-read")
            self._users += 1
            return self._executor

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            executor = self._executor if self._users == 0 else None
            if executor is not None:
                self._executor = None
        if executor is not None:  # the last stream's requests have all returned: this only joins idle threads
            executor.shutdown(wait=True)

    # -- staging budget ----------------------------------------------------------------------------
    def try_take(self, nbytes: int) -> bool:
        with self._lock:
            if self._held + nbytes > self.staging_cap:
                return False
            keep = self._hold(nbytes)
        self.host.trim(keep)
        return True

    def take_first(self, nbytes: int, stop: threading.Event, consumer: object) -> int | None:
        """Wait until `nbytes` fit the budget, or until no stream holding staging could give any back
        (see the module's doc), then hold them for a stream of `consumer`. Returns the bytes taken
        beyond the cap (0 or `nbytes`), or None if `stop` was set first."""
        with self._lock:
            _count(self._waiting, consumer, 1)
            self._freed.notify_all()  # a waiter of another consumer may find now that no holder can move
            try:
                # Not once every stream holding staging has a consumer waiting for a first slot (the
                # waiter's own streams among them): none could read on and give staging back.
                while self._held + nbytes > self.staging_cap and not all(c in self._waiting for c in self._holders):
                    if stop.is_set():
                        return None
                    self._freed.wait(0.05)  # a timeout only to see `stop`: `wake` notifies at once
            finally:
                _count(self._waiting, consumer, -1)
            over = nbytes if self._held + nbytes > self.staging_cap else 0
            self._over += over
            _count(self._holders, consumer, 1)
            keep = self._hold(nbytes)
        self.host.trim(keep)
        return over

    def _hold(self, nbytes: int) -> int:  # under the lock
        """Hold `nbytes`; returns how much kept staging may stay beside what streams hold (the cap's rest)."""
        self._held += nbytes
        self._peak = max(self._peak, self._held)
        return self.staging_cap - self._held

    def wake(self) -> None:
        with self._lock:
            self._freed.notify_all()

    def give_back(self, nbytes: int, consumer: object | None, over: int) -> None:
        """A stream's staging returns: `nbytes` in all, `over` of them taken beyond the cap."""
        with self._lock:
            self._held -= nbytes
            self._over -= over
            if consumer is not None:
                _count(self._holders, consumer, -1)
            self._freed.notify_all()

    def keep(self, slots: list[torch.Tensor]) -> None:
        """Keep a closed stream's host slots for later streams, within what the cap leaves free."""
        with self._lock:
            room = self.staging_cap - self._held
        self.host.give(slots, keep=room)

    def usage(self, reset_peak: bool) -> Usage:
        with self._lock:
            snapshot = Usage(self.reader_threads, self.staging_cap, self._held, self._peak, self._users,
                             self.host.kept, self._over, sum(self._waiting.values()))  # fmt: skip
            if reset_peak:
                self._peak = self._held
            return snapshot


def _count(counts: dict[object, int], key: object, change: int) -> None:
    """Add `change` to `counts[key]`, dropping the key at 0 (so `in` means "at least one")."""
    left = counts.get(key, 0) + change
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


def _task() -> object | None:
    """The async task running in this thread (asyncio or trio), else None. Only a library already imported
    can be running one, so plain code imports nothing here."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None:
        with contextlib.suppress(RuntimeError):  # no event loop runs in this thread
            if (task := asyncio.current_task()) is not None:
                return task
    trio = sys.modules.get("trio")
    if trio is not None:
        with contextlib.suppress(RuntimeError):  # not inside trio.run
            return trio.lowlevel.current_task()
    return None


_limits = _Limits(reader_threads=tuning.reader_threads(), staging_bytes=2 * tuning.GiB)


def set_limits(*, reader_threads: int | None = None, staging_bytes: int | str | None = None) -> None:
    """Set the process-wide reader thread pool size and staging memory cap (defaults: 2 threads per CPU,
    at least 8 and at most 32; 2 GiB). The cap is in bytes, or text with a unit ("8MiB").

    A new pool size applies from the next time no stream is running; a new cap at once (streams
    already holding more keep it until they end). The cap is exceeded only where a stream's first slot
    could never be had otherwise, by that slot (see the module's doc and `usage().staging_over`).
    """
    reader_threads = argument_checks.count(reader_threads, "reader_threads")  # an int: a float or text refused
    if reader_threads is not None:
        _limits.reader_threads = reader_threads
    staging_bytes = argument_checks.size(staging_bytes, "staging_bytes")
    if staging_bytes is not None:
        if staging_bytes < 4096:
            raise ValueError(f"staging_bytes must be at least 4096, not {staging_bytes}")
        _limits.staging_cap = staging_bytes
        _limits.host.trim(staging_bytes)


def usage(reset_peak: bool = False) -> Usage:
    """The limits and how much of them running streams use; `reset_peak` starts a new peak from now."""
    return _limits.usage(reset_peak)


def check_fits(nbytes: int, what: str) -> None:
    """Raise if `nbytes` of staging could never be had, however many streams end."""
    if nbytes > _limits.staging_cap:
        raise ValueError(
            f"{what} needs {nbytes} bytes of staging, larger than the process-wide staging cap of "
            f"{_limits.staging_cap}: use a smaller ring_bytes or more slots, "
            "or streamload.set_limits(staging_bytes=...)"
        )


def shared_limits() -> _Limits:
    return _limits


class Staging:
    """One stream's share of the staging budget: taken slot by slot, given back all at once. Made where the
    stream is opened, whose consumer is the async task that opened it, else the thread that takes its first slot."""

    def __init__(self) -> None:
        self.held = 0
        self.over = 0  # bytes of the first slot taken beyond the cap
        self._opener = _task()
        self._consumer: object | None = None

    def take_first(self, nbytes: int, stop: threading.Event) -> bool:
        """`_Limits.take_first` for this stream's consumer; False if `stop` was set while waiting."""
        check_fits(nbytes, "one ring slot with its buffers")
        consumer = self._opener if self._opener is not None else threading.current_thread()
        over = _limits.take_first(nbytes, stop, consumer)
        if over is None:
            return False
        self.held += nbytes
        self.over, self._consumer = over, consumer
        return True

    def try_take(self, nbytes: int) -> bool:
        if _limits.try_take(nbytes):
            self.held += nbytes
            return True
        return False

    def give_back(self) -> None:
        held, over, consumer = self.held, self.over, self._consumer
        self.held = self.over = 0
        self._consumer = self._opener = None  # a task or thread is not kept alive by a closed stream
        _limits.give_back(held, consumer, over)
