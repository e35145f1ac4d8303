"""The CUDA device: staged slots -> owned device tensors, on a stream of its own.

Slots live in device memory where a reader writes there (kvikio), else in host memory, each filled one
going to one device scratch buffer in a single asynchronous copy. Host slots are the process's kept ones
(limits.HostSlots): plain memory the reader threads fault in as they read, registered with CUDA
(`cudaHostRegister`) before its first copy, so no `cudaHostAlloc` of the whole ring comes before the
first tensor. Every tensor is its own allocation, written by one `copy_` from the slot's bytes viewed as
the stored dtype, so a dtype conversion costs nothing extra.

`instantiate` runs in the consumer's thread (the async face's: a worker thread, never the event loop)
and returns once its stream's work is complete: a tensor handed out is ready on any stream with no
synchronize by the caller, and its slot may be refilled. Tensors are allocated on the loader's stream
and marked, when handed out, with `record_stream` for the caller's current stream, so the caching
allocator never reuses their memory while the caller's queued work may still read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from streamload.base.limits import shared_limits
from streamload.base.tuning import DEVICE_STAGING
from streamload.device.base import Assembler, Delivered, Device, DeviceKind, HostRing, Into
from streamload.plan.plan import Batch
from streamload.storage import Files

log = logging.getLogger("streamload")


class CudaKind(DeviceKind):
    """CUDA devices: one loader stream a device, host slots registered with CUDA, tensors handed out
    tied to the receiving thread's current stream (`record_stream`: the module's docstring)."""

    type = "cuda"
    host_memory = False
    lands = ("host", "device")  # host slots copied over, or device slots kvikio reads into
    staging = DEVICE_STAGING
    collective_backend = "nccl"
    examples = ("'cuda'", "'cuda:N'")
    missing = "this torch sees no CUDA device"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def current_index(self) -> int:
        return torch.cuda.current_device()

    def indexed(self, dev: torch.device) -> torch.device:
        # in the caller's thread: worker threads (offload's fetches, the async face) see device 0 as current
        if dev.index is None and torch.cuda.is_available():
            return torch.device(self.type, torch.cuda.current_device())
        return dev

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def compute_capability(self) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    def fingerprint(self) -> str:
        return "cuda sm_{}{}".format(*torch.cuda.get_device_capability())

    def staging_device(self, dev: torch.device, into: Into) -> Device:
        return CudaDevice(dev, host_slots=into == "host")

    def hand_off(self, t: torch.Tensor) -> None:
        t.record_stream(torch.cuda.current_stream(t.device))

    def copy_stream(self, dev: torch.device) -> AbstractContextManager[object]:
        return torch.cuda.stream(loader_stream(dev))

    def mark_ready(self, dev: torch.device) -> object | None:
        ready = torch.cuda.Event()
        ready.record(loader_stream(dev))
        return ready

    def wait_ready(self, dev: torch.device, ready: object | None) -> None:
        if ready is not None:
            torch.cuda.current_stream(dev).wait_event(ready)  # type: ignore[arg-type]

    def synchronize(self, dev: torch.device) -> None:
        torch.cuda.synchronize(dev)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def pin_slot(self, slot: torch.Tensor, used: int) -> bool:
        return pin_host(slot, used)


class CudaDevice:
    staged = True
    padding = 0

    def __init__(self, device: torch.device, host_slots: bool) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.name = str(device)
        self.host_slots = host_slots
        self.buffers = 1 if host_slots else 0  # the device copy of a host slot
        self._stream = loader_stream(device)
        self._assembler = Assembler(device, stream=self._stream)
        self._scratch: torch.Tensor | None = None
        self._ring = HostRing()

    def new_slot(self, nbytes: int) -> torch.Tensor:
        if self.host_slots:
            return self._ring.new_slot(nbytes)
        slot = self._device_buffer(nbytes)
        # kvikio writes device slots outside any stream: work still queued on our stream in a block the
        # allocator handed back must be done first.
        self._stream.synchronize()
        return slot

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        # From our stream's pool: a block another stream freed with work still queued is never handed
        # to a writer (kvikio, our copies) that does not wait for that stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: Files) -> list[Delivered]:
        assert slot is not None
        with torch.cuda.device(self.device):
            if any(p.item.into is not None for p in batch.pieces):
                # Destinations are the caller's tensors: their queued work comes before our writes.
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            src = slot if slot.is_cuda else self._to_device(batch, slot)
            out = []
            for piece in batch.pieces:
                t = self._assembler.copy(piece, src, non_blocking=True)
                if t is not None:
                    out.append((piece.item.name, t))
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        return out

    def _to_device(self, batch: Batch, slot: torch.Tensor) -> torch.Tensor:
        used = batch.extent
        pin_host(slot, used)
        if self._scratch is None:
            self._scratch = self._device_buffer(slot.numel())
        with torch.cuda.stream(self._stream):
            self._scratch[:used].copy_(slot[:used], non_blocking=True)
        return self._scratch

    def close(self) -> None:
        self._assembler.clear()
        self._scratch = None
        self._ring.close()


_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def loader_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream per device that every load and fetch allocates and copies on. The caching
    allocator reuses a freed block only on the stream that allocated it: a new stream per load (from
    torch's pool of 32) would let reserved memory grow to ~32 x (block + scratch) under offload."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(torch.device("cuda", index))
        return stream


def pin_host(slot: torch.Tensor, used: int) -> bool:
    """Register a host slot's first `used` bytes with CUDA once per slot and process (an asynchronous
    copy from it needs it); False if CUDA refused, and copies from it still work, from pageable memory."""
    return shared_limits().host.pin(slot, _register, used)


_warned = False
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device and context, whichever is current


def _register(slot: torch.Tensor) -> Callable[[], None] | None:
    """Page-lock a host slot (the bytes given) for fast asynchronous copies; how to undo it, or None
    if CUDA refused, with CUDA's error cleared: torch's binding leaves it in the thread's last-error
    slot, where the next kernel launch (the dtype copy, or the caller's own) would report it."""
    global _warned
    cudart = torch.cuda.cudart()
    ptr = slot.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, slot.numel(), _PORTABLE))
    if err != 0:
        clear_cuda_error()
        if not _warned:
            _warned = True
            log.warning("streamload: cudaHostRegister failed (error %d); copying from pageable memory", err)
        return None

    def unregister() -> None:
        if int(cudart.cudaHostUnregister(ptr)) != 0:
            clear_cuda_error()
            log.warning("streamload: cudaHostUnregister failed for a staging slot")

    return unregister


def clear_cuda_error() -> None:
    """`cudaGetLastError()`, which torch's cudart binding lacks: called in the CUDA runtime torch loaded."""
    library = _cudart()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    paths: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            return ctypes.CDLL(path)
    process = ctypes.CDLL(None)  # statically linked into a library loaded globally
    return process if hasattr(process, "cudaGetLastError") else None
