"""The pipeline: plan -> read -> instantiate -> deliver, pulled by the consumer, with bounded memory.

Each `next_batch` call hands the reader threads the reads of as many upcoming batches as there are
free ring slots (this is the prefetch, and the backpressure: a slot is refilled only once its batch
was turned into tensors), waits for the next batch in plan order, turns its bytes into tensors and
frees its slot. Reads of later batches run on reader threads while the consumer works.

There is no event loop and no thread of the pipeline's own: the sync face calls `next_batch` in the
caller's thread, the async face on a worker thread, so a plain `for` pays for no event loop, no
portal and no async library import (measured: those were most of a warm CPU load's fixed cost). Only a
close on the main thread runs on a short-lived thread, which a Ctrl-C cannot cut short (`_shielded`).
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from streamload.base.errors import IntegrityError, ReadError, StreamloadError, listed
from streamload.base.gc_pause import collector_paused
from streamload.base.limits import Staging, shared_limits
from streamload.base.stats import Stats
from streamload.base.tuning import Tuning
from streamload.device import Delivered, Device
from streamload.integrity.whole import WholeFileMismatch
from streamload.plan.plan import Batch, Plan
from streamload.read import Reader
from streamload.read.pool import ReaderPool, Reads
from streamload.storage import Files, Storage

if TYPE_CHECKING:  # protocols cost import time to define, and only a type checker reads them

    class Waitable(Protocol):
        def wait(self) -> None: ...

    class Check(Protocol):
        """What checks a load's bytes as they arrive (verify.Verifier), or NoCheck."""

        def start(self, batch: Batch, slot: torch.Tensor | None, files: Any, reads: Waitable) -> Hashing: ...

        def finish(self, stats: Stats, files: Files) -> None: ...

        def close(self) -> None: ...


class Hashing:
    """A batch's hashing: `done`, and `wait` (which raises what it found)."""

    def __init__(self, futures: list[Future[None]], before_delivery: bool) -> None:
        self.futures, self.before_delivery = futures, before_delivery

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        for f in self.futures:
            f.result()


NOTHING = Hashing([], before_delivery=False)


class NoCheck:
    """What a load that verifies nothing does."""

    def start(self, batch: Batch, slot: torch.Tensor | None, files: Any, reads: Waitable) -> Hashing:
        return NOTHING

    def finish(self, stats: Stats, files: Files) -> None:
        pass

    def close(self) -> None:
        pass


class _Filling(NamedTuple):
    batch: Batch
    slot: torch.Tensor | None
    reads: Reads
    hashing: Hashing  # starts as soon as the reads are done, before the consumer reaches the batch


class Stopped(StreamloadError):
    """The pipeline was stopped (closed or cancelled) while a call waited in it."""


class Pipeline:
    """One stream's pipeline. `next_batch` is called by one thread at a time; `stop` from any thread."""

    def __init__(
        self,
        plan: Plan,
        storage: Storage,
        reader: Reader,
        device: Device,
        tuning: Tuning,
        stats: Stats,
        check: Check | None = None,
    ) -> None:
        self.plan, self.storage, self.reader, self.device, self.tuning = plan, storage, reader, device, tuning
        self.stats = stats
        self.check = check or NoCheck()
        self._hashing: deque[tuple[Hashing, torch.Tensor | None]] = deque()  # slots whose bytes are being hashed
        self._batches = iter(plan.batches)
        self._filling: deque[_Filling] = deque()
        self._free: list[torch.Tensor | None] = []
        self._files: Files | None = None
        self._pool: ReaderPool | None = None
        self._staging = Staging()
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held by next_batch; close waits for it
        self._started = self._closed = self._ended = False
        self._delivered = 0

    # -- the consumer's side ------------------------------------------------------------------------
    @collector_paused
    def next_batch(self) -> list[Delivered] | None:
        """The tensors of the next batch, in plan order; None once every batch was delivered.

        Raises `Stopped` if the pipeline was stopped, else the error that broke it (then it is closed).
        """
        with self._busy:
            if self._closed or self._stop.is_set():
                raise Stopped("the stream was closed")
            try:
                if not self._started:
                    self._start()
                if not self._filling:
                    self._end()
                    return None
                filling = self._filling.popleft()
                try:
                    filling.reads.wait()
                except WholeFileMismatch as exc:  # a storage's own verdict fails a read (a hub download's SHA-256)
                    self._name_handed_out(exc)
                    raise
                except StreamloadError:
                    raise
                except Exception as exc:  # a reader's error that does not say which file (a library's)
                    raise ReadError(f"{_paths(filling.batch)}: reading failed: {type(exc).__name__}: {exc}") from exc
                if self._stop.is_set():
                    raise Stopped("the stream was closed")
                made = self._instantiate(filling)
                if filling.hashing.before_delivery:  # tensors checked by their own digests are handed out checked
                    self._verdict(filling.hashing.wait)
                self._hashing.append((filling.hashing, filling.slot))
                self._settle()
                self._delivered = filling.batch.index + 1  # batches whose tensors went out
                return made
            except Stopped:
                raise
            except BaseException as exc:  # released where a Ctrl-C does not cut it short
                _shielded(self._release_all)
                if isinstance(exc, Exception) and not isinstance(exc, StreamloadError):  # not KeyboardInterrupt
                    raise StreamloadError(f"loading failed: {type(exc).__name__}: {exc}") from exc
                raise

    def stop(self) -> None:
        """Make a waiting or later `next_batch` raise `Stopped` soon (thread-safe, never blocks long)."""
        self._stop.set()
        if self._pool is not None:
            self._pool.stop()
        files = self._files
        if files is not None:
            files.cancel()  # requests in flight to a remote store are dropped, not waited for
        shared_limits().wake()

    def close(self) -> None:
        """Stop, wait for the reads that have begun, and release every file, slot and buffer (idempotent).
        A Ctrl-C meanwhile does not cut it short (`_shielded`)."""
        if self._closed and not self._busy.locked():  # released already (not being released now)
            return
        _shielded(self._close)

    def _close(self) -> None:
        self.stop()
        with self._busy:
            self._release_all()

    # -- inside ------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._started = True
        plan, device, t = self.plan, self.device, self.tuning
        self.stats.start()
        self._files = self.storage.open(plan.files, partly=lambda: _not_read_whole(plan))
        self._pool = ReaderPool(t.threads, self.stats.add_read)
        nslots = min(t.slots, max(1, len(plan.batches)))
        slot_bytes = t.slot_bytes + device.padding
        if device.staged:
            # Slots come from the process-wide staging budget: wait for the first (with the buffers
            # the device keeps besides the ring), take more only while the budget allows.
            if not self._staging.take_first(slot_bytes * (1 + device.buffers), self._stop):
                raise Stopped("the stream was closed while it waited for staging memory")
            nslots = 1 + sum(self._staging.try_take(slot_bytes) for _ in range(nslots - 1))
        else:
            # Slots hold no memory here, only read-ahead: batches beyond what the reader threads can
            # work on at once just compete with the first ones for the disk (measured: the first
            # tensor arrives ~2x later with 4 than with 2 in flight, for the same total time).
            nslots = min(nslots, 1 + -(-t.threads * t.chunk_bytes // t.slot_bytes))
        self._free = [device.new_slot(slot_bytes) for _ in range(nslots)]
        self._fill()

    def _fill(self) -> None:
        """Start the reads of the next batches, one per free slot, in plan order."""
        assert self._pool is not None and self._files is not None
        while self._free:
            batch = next(self._batches, None)
            if batch is None:
                return
            slot = self._free.pop()
            reads = self._pool.submit(self.reader.jobs(batch, slot, self._files))
            self._filling.append(_Filling(batch, slot, reads, self.check.start(batch, slot, self._files, reads)))

    def _settle(self) -> None:
        """Slots whose bytes are hashed go back to the ring (in plan order) and the next reads start;
        while every slot is still being hashed and nothing is being read, wait for the oldest."""
        while self._hashing:
            hashing, slot = self._hashing[0]
            if not hashing.done() and (self._filling or self._free):
                break
            self._verdict(hashing.wait)  # raises a mismatch it found
            self._hashing.popleft()
            self._free.append(slot)
        self._fill()

    def _end(self) -> None:
        """Every batch was delivered: the last hashes are waited for (a file's verdict comes at its end)."""
        if self._ended:
            return
        while self._hashing:
            self._verdict(self._hashing[0][0].wait)
            self._hashing.popleft()
        assert self._files is not None
        verdict = getattr(self._files, "verdict_at_end", None)  # a storage's own on what it served (storage/hub.py)
        if verdict is not None:
            self._verdict(verdict)
        self.check.finish(self.stats, self._files)
        self._ended = True
        self.stats.finish()

    def _verdict(self, wait: Callable[[], None]) -> None:
        """Wait for a verdict (a batch's hashing, a storage's own); a mismatch in a file checked as a whole
        also names the tensors of it that were handed out before its verdict (they must not be used)."""
        try:
            wait()
        except IntegrityError as exc:
            self._name_handed_out(exc)
            raise

    def _name_handed_out(self, exc: IntegrityError) -> None:
        if exc.path is not None and not exc.handed_out:
            done = self.plan.batches[: self._delivered]
            exc.handed_out = [p.item.name for b in done for p in b.pieces if p.last and p.item.info.path == exc.path]

    def _instantiate(self, filling: _Filling) -> list[Delivered]:
        assert self._files is not None
        batch = filling.batch
        try:
            return self.device.instantiate(batch, filling.slot, self._files)
        except StreamloadError:
            raise  # says what failed already (a cooperative exchange)
        except Exception as exc:
            what = f"making tensors {listed([p.item.name for p in batch.pieces], 3)} on {self.device.name}"
            raise StreamloadError(f"{_paths(batch)}: {what} failed: {exc}") from exc

    def _release_all(self) -> None:
        """Everything the pipeline holds goes: reads are waited for, then files, slots and buffers."""
        if self._closed:
            return
        self._closed = True
        pool = self._pool
        try:
            if pool is not None:
                pool.close()  # every read has returned: nothing writes into a slot or uses a descriptor
        finally:
            if pool is None or pool.idle:  # else a wait cut short: a read may still write a slot, nothing is freed
                self._release_held()

    def _release_held(self) -> None:
        """Files, slots and buffers go (no read runs any more)."""
        self._filling.clear()
        self._free.clear()
        self._batches = iter(())  # the plan's batches: `into=`'s tensors among them
        try:
            self.check.close()  # no thread hashes a slot's bytes any more
            self._hashing.clear()
            self.reader.close()
            if self._files is not None:
                self._files.close()
        finally:  # whatever failed above, the device gives its slots back (unregistered if dropped)
            self.stats.staging_bytes = max(self.stats.staging_bytes, self._staging.held)
            self._staging.give_back()
            self.device.close()  # after the budget is given back: slots kept for later streams fit in it
            self._files = self._pool = None


def _shielded(work: Callable[[], None]) -> None:
    """Run `work` to its end whatever Ctrl-C does meanwhile.

    A KeyboardInterrupt is raised only in the main thread, so there `work` runs on a thread of its own and
    the caller waits for it: an interrupt stops the waiting, never the work halfway (a descriptor closed or a
    slot handed to the next stream while a read still uses it, the rest never released). The first interrupt
    is held until the work is done, then raised; a second (or one while an interrupt is already being
    handled) is raised at once, and the work still finishes, on its thread.
    """
    if threading.current_thread() is not threading.main_thread():
        work()
        return
    shield = _Shield(work)
    held: BaseException | None = None
    patient = not isinstance(sys.exc_info()[1], KeyboardInterrupt)
    while True:
        try:
            shield.wait()
            break
        except KeyboardInterrupt as exc:
            if held is not None or not patient:
                shield.abandon(exc)
            held = exc
    if held is not None:
        raise held


class _Shield:
    """`work`, run once on a thread of its own (see `_shielded`)."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._lock = threading.Lock()
        self._claimed = self._started = self._abandoned = False
        self._error: BaseException | None = None
        self._runner: threading.Thread | None = None
        self._done = threading.Event()

    def wait(self) -> None:
        """Start the thread (again, if a Ctrl-C came while it was being started: only one runs the work),
        wait for the work to end and raise its error."""
        if not self._started:
            thread = threading.Thread(target=self._run, name="streamload-close", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new thread (the interpreter is exiting, or none can be made)
                self._run()
            self._started = True
        self._done.wait()
        runner = self._runner
        if runner is not None and runner is not threading.current_thread():
            runner.join()  # (a second thread, started after a Ctrl-C in the first's start, ends at once)
        if self._error is not None:
            raise self._error

    def abandon(self, interrupt: KeyboardInterrupt) -> None:
        """Stop waiting: the work ends on its own, and an error of it then goes to the thread's excepthook."""
        with self._lock:
            self._abandoned = True
            error = self._error
        if error is not None:
            raise interrupt from error
        raise interrupt

    def _run(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed, self._runner = True, threading.current_thread()
        try:
            self._work()
        except BaseException as exc:
            with self._lock:
                self._error, abandoned = exc, self._abandoned
            if abandoned:
                raise
        finally:
            self._done.set()


def _not_read_whole(plan: Plan) -> set[PurePath]:
    """The files this process does not read every byte of itself: those its plan reads in part, and in a
    cooperative load those with bytes in shared batches (the other ranks read parts of those: a cache
    copy this rank claimed would never be completed, and a rank waiting for it would wait for ever)."""
    shared = {piece.item.info.path for batch in plan.batches if batch.shared for piece in batch.pieces}
    return {*plan.read_in_part(), *shared}


def _paths(batch: Batch) -> str:
    """The batch's files, as an error names them (readers' own errors name file and offset)."""
    return ", ".join(sorted({str(p.item.info.path) for p in batch.pieces}))
