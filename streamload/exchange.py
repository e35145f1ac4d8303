"""Cooperative loading: ranks that need the same bytes each read a share and all-gather the rest.

Every rank of the process group builds the same shared batches (plan.py packs them apart from what
a rank reads for itself). For each one, rank r reads the r-th of `world` equal parts of the slot's
bytes, then one `all_gather_single` into the slot itself leaves the whole batch on every rank: storage
sees each byte once. The pipeline instantiates batches strictly in plan order, one at a time, and
exchanges a shared batch just before instantiating it, so every rank issues the same collectives in
the same order while later batches are still being read.

Where the bytes meet: a gloo group exchanges host slots; an NCCL group exchanges device memory: a
device slot in place, or a host slot through one device buffer of a slot's size (the only extra
memory the exchange takes).

A rank that fails, stops early or hangs must be an error on the others, not a hang: every collective is
waited for with a deadline a little shorter than the process group's own timeout. An NCCL collective
that misses it would otherwise spin on the GPU until NCCL's watchdog ends the whole process; the
exchange aborts the group's communicators instead (the group is unusable afterwards, as after any NCCL
timeout).

A lost rank costs the others time, not the load: once an exchange fails (a rank died, its link broke,
or it did not answer in time), each surviving rank says so once, reads what the others would have
shared from storage itself — the rest of the batch at hand and of every batch already read in part —
and reads every later batch whole, without the group. Only when storage cannot serve those bytes
either is the load an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from .device import Delivered, Device
from .errors import StreamloadError, UnsupportedError
from .plan import Batch, Item
from .read import Job, Reader
from .source import Checkpoint

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

log = logging.getLogger("streamload")

# The share of the process group's timeout the exchange waits for a collective: it must act before
# NCCL's watchdog (which checks the same timeout) tears the process down.
DEADLINE_SHARE = 0.8


def all_gather(output: torch.Tensor, part: torch.Tensor, group: ProcessGroup | None = None) -> Work:
    """Start gathering every rank's equal-sized `part`, concatenated into `output` (in place when
    `part` is its own slice of `output`); returns the collective's work handle.
    `all_gather_single` where torch has it, its older name elsewhere."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, part, group=group, async_op=True)


def group_timeout(group: ProcessGroup | None, device: torch.device) -> timedelta:
    """The timeout the process group's backend for `device` was created with (torch's default where
    the backend does not tell)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    try:
        timeout = pg._get_backend(device).options._timeout
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError):
        pass
    nccl = getattr(dist, "default_pg_nccl_timeout", None)  # NCCL's is shorter (its watchdog acts on it)
    return nccl if device.type == "cuda" and isinstance(nccl, timedelta) else dist.default_pg_timeout


def wait(work: Work, deadline: float, abort: Any) -> None:
    """Block until `work` completes; past `deadline` (a `time.monotonic()` value) call `abort(work)` and
    raise TimeoutError. The backend's own error, if the collective failed, is raised as it is."""
    pause = 50e-6
    while not work.is_completed():
        if time.monotonic() > deadline:
            abort(work)
            raise TimeoutError("no answer from the other ranks in time")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)  # quick collectives are seen quickly, long ones cost no CPU
    work.wait()


class Exchange:
    """The ranks of `group` (None: the default group) loading the same checkpoint together."""

    def __init__(self, group: ProcessGroup | None, device: torch.device) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("cooperative loading needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        # On a CUDA device, exchange device memory when the group speaks NCCL; else go through host memory.
        self.on_device = device.type == "cuda" and "nccl" in backend
        if not self.on_device and "nccl" in backend and "gloo" not in backend:
            raise UnsupportedError(
                f"cooperative loading to {device} needs a process group that can exchange host memory "
                f"(gloo), not {backend!r}"
            )
        self.device = device
        if self.on_device:
            from .device.cuda import loader_stream

            self._stream: torch.cuda.Stream | None = loader_stream(device)
        else:
            self._stream = None
        self._buffer: torch.Tensor | None = None
        self._pg = group if group is not None else dist.group.WORLD
        self.timeout = group_timeout(group, device if self.on_device else torch.device("cpu"))
        self.aborted = False
        self.lost: str = ""  # why the group is no longer used (a rank lost): every rank then reads alone

    def _collective(self, output: torch.Tensor, part: torch.Tensor) -> None:
        """All-gather `part` into `output`, waited for with a deadline (see the module's docstring)."""
        work = all_gather(output, part, self.group)
        wait(work, time.monotonic() + self.timeout.total_seconds() * DEADLINE_SHARE, self._abort)

    def _abort(self, work: Work) -> None:
        if self.on_device:  # NCCL: a collective that would spin on the GPU until the watchdog ends the process
            self._pg.abort()
            self.aborted = True
            return
        # gloo: its thread may still write into the slot until gloo's own timeout (the other 20%); the
        # slot is given back (to later loads) only once it no longer can.
        with contextlib.suppress(Exception):
            work.wait()

    @property
    def buffers(self) -> int:
        """Slot-sized buffers the exchange may keep besides the ring (for host slots on an NCCL group)."""
        return 1 if self.on_device else 0

    @property
    def padding(self) -> int:
        """Bytes a slot needs beyond the plan's slot size: the last part is rounded up."""
        return self.world

    def _part(self, batch: Batch) -> tuple[int, int]:
        size = -(-batch.extent // self.world)
        return self.rank * size, size

    def own_part(self, batch: Batch) -> Batch:
        """The part of a shared batch this rank reads."""
        lo, size = self._part(batch)
        return batch.window(lo, lo + size)

    def gather(self, batch: Batch, slot: torch.Tensor) -> torch.Tensor:
        """Blocking: every rank's part of `batch` into one buffer (`slot`, or the device buffer), returned."""
        lo, size = self._part(batch)
        target = slot
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            if self.on_device and not slot.is_cuda:
                from .device.cuda import pin_host

                pin_host(slot, batch.extent)
                if self._buffer is None:
                    self._buffer = torch.empty(slot.numel(), dtype=torch.uint8, device=self.device)
                target = self._buffer
                target[lo : lo + size].copy_(slot[lo : lo + size], non_blocking=True)
            try:
                self._collective(target[: size * self.world], target[lo : lo + size])
            except Exception as exc:
                raise self._failed(batch, exc) from exc
        return target

    def agree(self, checkpoint: Checkpoint, candidates: Sequence[Item], layout: str) -> set[str]:
        """Blocking, collective: the names among `candidates` (tensors this rank reads whole) that every
        rank reads whole. First checks that all ranks load the same checkpoint with the same layout."""
        names = sorted(checkpoint.tensors)
        digest = hashlib.sha256(layout.encode())
        for n in names:
            t = checkpoint.tensors[n]
            digest.update(f"{n}\0{t.path.name}\0{t.dtype.name}\0{t.shape}\0{t.begin}\0{t.end}\0".encode())
        mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
        try:
            digests = self._gather_small(mine)
            differ = [r for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
            if differ:
                raise StreamloadError(
                    f"cooperative loading: ranks {differ} load a different checkpoint (or ring layout: "
                    f"slot size, order) than rank 0; every rank of the group must call iter() alike"
                )
            wanted = {i.name for i in candidates}
            mask = torch.tensor([n in wanted for n in names], dtype=torch.uint8)
            everyone = self._gather_small(mask).min(dim=0).values
        except StreamloadError:
            raise
        except Exception as exc:
            raise StreamloadError(
                f"cooperative loading: rank {self.rank} of {self.world}: agreeing on the plan with the "
                f"other ranks failed (every rank must call iter() with cooperative loading): {exc}"
            ) from exc
        return {n for n, keep in zip(names, everyone.tolist(), strict=True) if keep}

    def _gather_small(self, t: torch.Tensor) -> torch.Tensor:
        """All ranks' `t`, stacked (on the device the group exchanges)."""
        where = self.device if self.on_device else torch.device("cpu")
        t = t.to(where)
        out = torch.empty((self.world, t.numel()), dtype=t.dtype, device=where)
        self._collective(out.view(-1), t)
        return out.cpu()

    def _failed(self, batch: Batch, exc: Exception) -> StreamloadError:
        names = sorted({p.item.name for p in batch.pieces})
        paths = sorted({str(p.item.info.path) for p in batch.pieces})
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        return StreamloadError(
            f"{', '.join(paths)}: rank {self.rank} of {self.world}: exchanging tensors {shown} with the other "
            f"ranks failed; a rank failed, stopped early, or did not answer within "
            f"{self.timeout.total_seconds() * DEADLINE_SHARE:.3g} s ({DEADLINE_SHARE:.0%} of the process "
            f"group's timeout){'; the process group was aborted' if self.aborted else ''}: {exc}"
        )

    def close(self) -> None:
        self._buffer = None


class CooperativeReader:
    """A reader that reads only this rank's part of each shared batch (the others read the rest), and
    the whole batch once the group is lost."""

    def __init__(self, reader: Reader, exchange: Exchange) -> None:
        self.reader, self.exchange = reader, exchange
        self.name = reader.name
        self.partial: set[int] = set()  # shared batches read in part: the rest comes from the others

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> list[Job]:
        if batch.shared and not self.exchange.lost:
            self.partial.add(batch.index)
            return self.reader.jobs(self.exchange.own_part(batch), slot, files)
        return self.reader.jobs(batch, slot, files)

    def rest(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> None:
        """Blocking: the parts of `batch` the other ranks would have shared, read here."""
        lo, size = self.exchange._part(batch)
        for window in (batch.window(0, lo), batch.window(lo + size, batch.extent)):
            if window.pieces:
                for job in self.reader.jobs(window, slot, files):
                    job()

    def close(self) -> None:
        self.reader.close()


class CooperativeDevice:
    """A device whose shared batches are first completed by all-gather from the other ranks' parts (or,
    once the group is lost, by reading those parts: `reader`)."""

    def __init__(self, device: Device, exchange: Exchange, reader: CooperativeReader) -> None:
        self.device, self.exchange, self.reader = device, exchange, reader
        self.name, self.staged = device.name, device.staged
        self.buffers = device.buffers + exchange.buffers
        self.padding = exchange.padding  # the last rank's part is rounded up

    def new_slot(self, nbytes: int) -> torch.Tensor | None:
        return self.device.new_slot(nbytes)

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> list[Delivered]:
        if batch.shared and slot is not None and batch.index in self.reader.partial:
            if not self.exchange.lost:
                try:
                    slot = self.exchange.gather(batch, slot)  # a collective: in plan order on every rank
                except StreamloadError as exc:
                    self.exchange.lost = str(exc)
                    log.warning("streamload: %s; this rank reads the rest from storage itself", exc)
            if self.exchange.lost:
                self.reader.rest(batch, slot, files)
        return self.device.instantiate(batch, slot, files)

    def close(self) -> None:
        try:
            self.exchange.close()
        finally:
            self.device.close()


def cooperative(reader: Reader, device: Device, exchange: Exchange) -> tuple[Reader, Device]:
    """The reader/device pair of a cooperative load: the pipeline runs it like any other."""
    cooperative_reader = CooperativeReader(reader, exchange)
    return cooperative_reader, CooperativeDevice(device, exchange, cooperative_reader)
