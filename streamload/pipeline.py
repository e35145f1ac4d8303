"""The pipeline: plan -> read -> instantiate -> deliver, as an anyio task group with bounded memory.

A filler task takes a free slot from the ring (this is the backpressure), starts the reader's jobs for
the next batch on reader threads and queues the batch; the instantiator takes batches in plan order,
waits for their bytes, turns them into tensors (on a worker thread unless that is cheap: views),
returns the slot to the ring and sends the tensors to the consumer. Reads of later batches run while
earlier ones are instantiated.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import torch
from anyio import create_memory_object_stream, create_task_group, to_thread
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .device import Delivered, Device
from .errors import StreamloadError
from .exchange import Exchange
from .limits import Staging
from .plan import Batch, Plan
from .read import OpenFiles, Reader
from .read.pool import ReaderPool
from .stats import Stats

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

MiB = 1 << 20


@dataclass(frozen=True)
class Tuning:
    """How much memory and how many threads a stream uses."""

    ring_bytes: int = 256 * MiB  # all staging slots together
    slots: int = 4  # ring slots: reads of up to `slots` batches are in flight
    threads: int = 8  # reader threads
    chunk_bytes: int = 8 * MiB  # the most one read request asks for
    buffer: int = 16  # tensors made but not yet taken by the consumer (memory beyond the ring)

    @property
    def slot_bytes(self) -> int:
        return self.ring_bytes // self.slots // 64 * 64

    def check(self) -> None:
        if self.slots < 1 or self.threads < 1 or self.buffer < 0:
            raise ValueError("slots and threads must be >= 1, buffer >= 0")
        if self.slot_bytes < 4096:
            raise ValueError(
                f"ring of {self.ring_bytes} bytes in {self.slots} slots gives slots under 4 KiB; "
                "make the ring larger or the slots fewer"
            )
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, not {self.chunk_bytes}")


@dataclass
class _Failure:
    error: BaseException


@dataclass
class _Filling:
    batch: Batch
    slot: torch.Tensor | None
    done: anyio.Event = field(default_factory=anyio.Event)


Receiver = MemoryObjectReceiveStream["Delivered | _Failure"]


@asynccontextmanager
async def open_pipeline(
    plan: Plan, reader: Reader, device: Device, tuning: Tuning, stats: Stats, exchange: Exchange | None = None
) -> AsyncIterator[Receiver]:
    """Run the pipeline for as long as the block runs; yields the stream the tensors arrive on.
    With `exchange`, shared batches are read in part and completed by the other ranks.

    Leaving the block early cancels reads, waits for reader threads to finish their current request,
    closes the files and drops the staging memory.
    """
    files = OpenFiles(plan.files)
    pool = ReaderPool(tuning.threads, stats.add_read)
    staging = Staging()
    body_error: Exception | None = None
    try:
        send, receive = create_memory_object_stream["Delivered | _Failure"](tuning.buffer)
        async with create_task_group() as tg:
            stats.start()
            tg.start_soon(_Stages(plan, reader, device, files, pool, tuning, exchange, staging).report, send)
            try:
                with receive:
                    yield receive
            except Exception as exc:  # the caller's own error: keep the task group from wrapping it
                body_error = exc
            finally:
                pool.stop()
                tg.cancel_scope.cancel()
        if body_error is not None:
            raise body_error
    finally:
        pool.close()  # every read has returned by now: nothing writes into a slot or uses a descriptor
        reader.close()
        files.close()
        device.close()
        if exchange is not None:
            exchange.close()
        stats.staging_bytes = staging.held
        staging.give_back()


async def next_tensor(receive: Receiver, stats: Stats) -> Delivered | None:
    """The next tensor, None at the end; raises the error that stopped the pipeline."""
    try:
        item = await receive.receive()
    except anyio.EndOfStream:
        stats.finish()
        return None
    return _accept(item, stats)


def ready_tensor(receive: Receiver, stats: Stats) -> Delivered | None:
    """A tensor that is already waiting, else None (also at the end: `next_tensor` then says so)."""
    try:
        item = receive.receive_nowait()
    except (anyio.WouldBlock, anyio.EndOfStream):
        return None
    return _accept(item, stats)


def _accept(item: Delivered | _Failure, stats: Stats) -> Delivered:
    if isinstance(item, _Failure):
        stats.finish()
        raise item.error
    stats.delivered()
    return item


@dataclass
class _Stages:
    plan: Plan
    reader: Reader
    device: Device
    files: OpenFiles
    pool: ReaderPool
    tuning: Tuning
    exchange: Exchange | None
    staging: Staging

    async def report(self, send: MemoryObjectSendStream[Delivered | _Failure]) -> None:
        """Run the stages; an error in any of them goes to the consumer as the next item."""
        async with send:
            try:
                await self.run(send)
            except Exception as exc:
                try:
                    await send.send(_Failure(_surface(exc)))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass

    async def run(self, send: MemoryObjectSendStream[Delivered | _Failure]) -> None:
        plan, device, pool = self.plan, self.device, self.pool
        nslots = min(self.tuning.slots, max(1, len(plan.batches)))
        slot_bytes = self.tuning.slot_bytes + (self.exchange.padding if self.exchange is not None else 0)
        if device.staged:
            # Slots come from the process-wide staging budget: wait for the first (with the buffers
            # the device and exchange keep besides the ring), take more only while the budget allows.
            buffers = device.buffers + (self.exchange.buffers if self.exchange is not None else 0)
            await self.staging.take_first(slot_bytes * (1 + buffers))
            nslots = 1 + sum(self.staging.try_take(slot_bytes) for _ in range(nslots - 1))
        else:
            # Slots hold no memory here, only read-ahead: batches beyond what the reader threads can
            # work on at once just compete with the first ones for the disk (measured: the first
            # tensor arrives ~2x later with 4 than with 2 in flight, for the same total time).
            t = self.tuning
            nslots = min(nslots, 1 + -(-t.threads * t.chunk_bytes // t.slot_bytes))
        free_send, free_receive = create_memory_object_stream[torch.Tensor | None](nslots)
        for _ in range(nslots):
            free_send.send_nowait(device.new_slot(slot_bytes))
        filled_send, filled_receive = create_memory_object_stream[_Filling](nslots)

        async def read(filling: _Filling) -> None:
            batch = filling.batch
            if batch.shared and self.exchange is not None:
                batch = self.exchange.own_part(batch)
            try:
                await pool.run_async(self.reader.jobs(batch, filling.slot, self.files))
            except BaseException:
                pool.stop()  # the stream fails: later requests need not run
                raise
            filling.done.set()

        async def fill(tg: TaskGroup) -> None:
            async with filled_send:
                for batch in plan.batches:
                    filling = _Filling(batch, await free_receive.receive())
                    tg.start_soon(read, filling)
                    await filled_send.send(filling)

        async with create_task_group() as tg, free_send, free_receive, filled_receive:
            tg.start_soon(fill, tg)
            async for filling in filled_receive:
                await filling.done.wait()
                if device.cheap(filling.batch) and not filling.batch.shared:
                    made = _instantiate(device, filling, self.files, self.exchange)
                else:
                    made = await to_thread.run_sync(_instantiate, device, filling, self.files, self.exchange)
                free_send.send_nowait(filling.slot)
                for delivered in made:
                    await send.send(delivered)


def _instantiate(device: Device, filling: _Filling, files: OpenFiles, exchange: Exchange | None) -> list[Delivered]:
    slot = filling.slot
    if filling.batch.shared and exchange is not None and slot is not None:
        slot = exchange.gather(filling.batch, slot)  # a collective: in plan order on every rank
    try:
        return device.instantiate(filling.batch, slot, files)
    except Exception as exc:
        names = ", ".join(repr(p.item.name) for p in filling.batch.pieces[:3])
        paths = sorted({str(p.item.info.path) for p in filling.batch.pieces})
        raise StreamloadError(
            f"{', '.join(paths)}: making tensors {names}{' ...' if len(filling.batch.pieces) > 3 else ''} "
            f"on {device.name} failed: {exc}"
        ) from exc


def _surface(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, as a StreamloadError."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        exc = (inner or exc.exceptions)[0]
    if isinstance(exc, StreamloadError):
        return exc
    err = StreamloadError(f"loading failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
