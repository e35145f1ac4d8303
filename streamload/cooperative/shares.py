"""Who reads which share: ranks that need the same bytes each read a part and all-gather the rest.

Every rank of the process group builds the same shared batches (plan/plan.py packs them apart from what
a rank reads for itself). For each one, rank r reads the r-th of `world` equal parts of the slot's
bytes, then one `all_gather_single` into the slot itself leaves the whole batch on every rank: storage
sees each byte once. The pipeline instantiates batches strictly in plan order, one at a time, and
exchanges a shared batch just before instantiating it, so every rank issues the same collectives in
the same order while later batches are still being read.

Where the bytes meet: a gloo group exchanges host slots; an NCCL group exchanges device memory: a
device slot in place, or a host slot through one device buffer of a slot's size (the only extra
memory the exchange takes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from streamload.base.errors import StreamloadError
from streamload.cooperative import agreement, lost_rank
from streamload.cooperative.group import Group
from streamload.device import Delivered, Device
from streamload.plan.plan import Batch
from streamload.read import Reader, Work


class Exchange(Group):
    """The ranks of a group loading one checkpoint together: they agree on the plan and their files
    (agreement.py), then complete each shared batch from every rank's part, a rank lost or not
    (lost_rank.py); those modules' functions of a group are its methods here."""

    agree = agreement.agree
    complete = lost_rank.complete


class CooperativeReader:
    """A reader that reads only this rank's part of each shared batch (the others read the rest), and
    the whole batch once the group is lost."""

    def __init__(self, reader: Reader, exchange: Exchange) -> None:
        self.reader, self.exchange = reader, exchange
        self.name = reader.name
        self.partial: dict[int, tuple[int, ...]] = {}  # shared batch read in part -> the ranks that read it
        self.on_bytes: Callable[[int], None] = lambda n: None  # counts what `read` brings in (the load's stats)

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> Sequence[Work]:
        if batch.shared and not self.exchange.lost:
            self.partial[batch.index] = self.exchange.members
            lo, size = self.exchange.part(batch)
            return self.reader.jobs(batch.window(lo, lo + size), slot, files)
        return self.reader.jobs(batch, slot, files)

    def read(self, window: Batch, slot: torch.Tensor | None, files: Any) -> None:
        """Blocking: the bytes of `window` (a part of a batch) read into `slot` on this thread."""
        for job in self.reader.jobs(window, slot, files):
            self.on_bytes(job if isinstance(job, int) else job())

    def close(self) -> None:
        self.reader.close()


class CooperativeDevice:
    """A device whose shared batches are first completed by all-gather from the other ranks' parts (or,
    once the group is lost, by reading those parts: `reader`)."""

    def __init__(self, device: Device, exchange: Exchange, reader: CooperativeReader) -> None:
        self.device, self.exchange, self.reader = device, exchange, reader
        self.name, self.staged = device.name, device.staged
        self.buffers = device.buffers + int(exchange.on_device)  # a host slot is gathered in a device buffer
        self.padding = exchange.world  # the last rank's part is rounded up
        self.check: CooperativeCheck | None = None  # verify=: told when a shared batch is whole in its slot

    def new_slot(self, nbytes: int) -> torch.Tensor | None:
        return self.device.new_slot(nbytes)

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> list[Delivered]:
        then = self.reader.partial.pop(batch.index, None)
        try:
            if batch.shared and slot is not None and then is not None:
                target = slot
                slot = self.exchange.complete(batch, slot, then, lambda window: self.reader.read(window, target, files))
                if self.check is not None and slot is not target:  # gathered on the device: hashed on the host
                    target[: batch.extent].copy_(slot[: batch.extent])
        except BaseException as exc:
            if self.check is not None:
                self.check.completed(batch, exc)
            raise
        if self.check is not None:
            self.check.completed(batch, None)
        return self.device.instantiate(batch, slot, files)

    def close(self) -> None:
        try:
            self.exchange.close()
        finally:
            self.device.close()


class _Whole:
    """Waitable: a shared batch's slot holds every rank's part (or the exchange failed)."""

    def __init__(self, reads: Any) -> None:
        self.reads = reads
        self.event = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.reads.wait()
        self.event.wait()
        if self.error is not None:
            raise self.error


class CooperativeCheck:
    """verify= in a cooperative load: a shared batch is hashed once the exchange has made it whole in
    the slot, so each rank checks every byte it hands out, the parts its peers read included (and
    those read from storage for a lost rank); its own batches are hashed as they are read."""

    def __init__(self, check: Any, device: CooperativeDevice) -> None:
        self.check = check
        self._waiting: dict[int, _Whole] = {}
        self._lock = threading.Lock()
        device.check = self

    def start(self, batch: Batch, slot: torch.Tensor | None, files: Any, reads: Any) -> Any:
        if not (batch.shared and slot is not None):
            return self.check.start(batch, slot, files, reads)
        whole = _Whole(reads)
        with self._lock:
            self._waiting[batch.index] = whole
        return self.check.start(batch, slot, files, whole)

    def completed(self, batch: Batch, error: BaseException | None) -> None:
        with self._lock:
            whole = self._waiting.pop(batch.index, None)
        if whole is not None:
            whole.error = error
            whole.event.set()

    def finish(self, stats: Any, files: Any) -> None:
        self.check.finish(stats, files)

    def close(self) -> None:
        with self._lock:  # hashing threads still waiting for an exchange stop waiting
            waiting, self._waiting = self._waiting, {}
        for whole in waiting.values():
            whole.error = StreamloadError("the load was stopped")
            whole.event.set()
        self.check.close()


def cooperative(reader: Reader, device: Device, exchange: Exchange) -> tuple[Reader, Device]:
    """The reader/device pair of a cooperative load: the pipeline runs it like any other."""
    cooperative_reader = CooperativeReader(reader, exchange)
    return cooperative_reader, CooperativeDevice(device, exchange, cooperative_reader)
