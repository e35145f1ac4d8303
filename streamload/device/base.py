"""The device interface, the device kind every torch device type streamload serves has, and the
piece-by-piece copy every staging device shares."""

from __future__ import annotations

import contextlib
import ctypes
from contextlib import AbstractContextManager
from typing import Literal, Protocol

import torch

from streamload.base.limits import shared_limits
from streamload.base.tuning import Staging
from streamload.format.dtypes import torch_shape
from streamload.plan.plan import Batch, Item, Piece
from streamload.storage import Files

Delivered = tuple[str, torch.Tensor]
# Where a reader's bytes land: staging slots in host memory, the page cache viewed in place (file
# mappings), or staging slots in device memory (kvikio's).
Into = Literal["host", "mapped", "device"]

# Copies this small between host tensors keep the GIL: torch's copy_ (and ctypes.memmove) give it up
# for the few microseconds of the copy and then queue for it behind the reader threads, up to the
# interpreter's switch interval (5 ms) each time; measured, 291 copies of 64 KB cost 2.5 s so on a busy
# machine (a converting from_pretrained of 12,579 tensors), the copies themselves ~1 ms.
_SMALL_COPY = 1 << 20
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
)


class Device(Protocol):
    """Where staging lives, how a slot becomes tensors, and when a slot may be reused.

    The pipeline calls `new_slot` once per ring slot, then `instantiate` for each filled batch, in
    plan order, on the consumer's thread (or the async face's worker thread); when `instantiate`
    returns, the slot may be refilled.
    """

    name: str
    staged: bool  # False: readers make bytes resident in file mappings and slots hold nothing
    buffers: int  # slot-sized buffers kept besides the ring (counted against the staging budget)
    padding: int  # bytes a slot needs beyond the plan's slot size

    def new_slot(self, nbytes: int) -> torch.Tensor | None: ...

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: Files) -> list[Delivered]: ...

    def close(self) -> None: ...


class DeviceKind:
    """Everything streamload does differently on one torch device type, asked of its kind (one object a
    type, registered in device/kinds.py's KINDS): nothing outside device/ compares a device type.

    The defaults are the host's: an operation an accelerator needs (streams, pinning, hand-off) does
    nothing here. A new device type is a module with its staging `Device` and its kind, and one row."""

    type: str  # torch's device type
    host_memory: bool  # its tensors are in host memory: file-mapping views, CPU kernels' alignment, page release
    lands: tuple[Into, ...]  # where a reader's bytes may land for a load onto it
    staging: Staging  # its tuning defaults (base/tuning.py)
    collective_backend: str  # the torch.distributed backend that exchanges its memory
    examples: tuple[str, ...]  # how a caller names its devices, for errors
    missing = ""  # why a device of this type cannot be used, where `available()` says so

    def available(self) -> bool:
        return True

    def current_index(self) -> int:
        """The index a device of this type named without one means, in the calling thread."""
        return 0

    def indexed(self, dev: torch.device) -> torch.device:
        """`dev` with the index it means in the calling thread, where the type has indices."""
        return dev

    def device_count(self) -> int:
        return 1

    def compute_capability(self) -> tuple[int, int] | None:
        """(major, minor) of the current device, for kernels that need one (FP8, MXFP4); None: no such kernels."""
        return None

    def fingerprint(self) -> str:
        """What compiled code for this kind depends on, on this machine (vLLM's compile caches)."""
        return f"{self.type} {torch.backends.cpu.get_cpu_capability()}"

    def staging_device(self, dev: torch.device, into: Into) -> Device:
        """The device that turns the bytes a reader landed `into` into tensors on `dev` (each kind's own)."""
        raise NotImplementedError(f"the {self.type} device kind builds no staging device")

    def hand_off(self, t: torch.Tensor) -> None:
        """Tie a tensor handed to the caller to the caller's work on it (called in the receiving thread),
        so that its memory is not reused while that work may still read it."""

    def copy_stream(self, dev: torch.device) -> AbstractContextManager[object]:
        """Within it, copies onto `dev` queue on the loader's copy stream (one a device: see device/cuda.py)."""
        return contextlib.nullcontext()

    def mark_ready(self, dev: torch.device) -> object | None:
        """A marker recorded after the copies queued so far on `dev`'s copy stream (None: they are done)."""
        return None

    def wait_ready(self, dev: torch.device, ready: object | None) -> None:
        """The calling thread's current work on `dev` waits for `ready` on the device, not the host."""

    def synchronize(self, dev: torch.device) -> None:
        """Block until the work queued on `dev` is done."""

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (host memory) where copies from it to this kind's devices are asynchronous."""
        return t

    def pin_slot(self, slot: torch.Tensor, used: int) -> bool:
        """Make a kept host slot's first `used` bytes ready for asynchronous copies (once a slot); False
        where it stays as it is (copies from it still work)."""
        return False


class HostRing:
    """The host slots one stream's device took from the process (see limits.HostSlots); `close`
    gives them back for later streams."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor] = []

    def new_slot(self, nbytes: int) -> torch.Tensor:
        slot = shared_limits().host.take(nbytes)
        self.slots.append(slot)
        return slot

    def close(self) -> None:
        slots, self.slots = self.slots, []
        shared_limits().keep(slots)


class Assembler:
    """Copies pieces from slots into freshly allocated tensors; a tensor is delivered with its last piece.

    Tensors larger than a slot arrive in several pieces, in order, on consecutive batches.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self._stream = stream  # allocations and copies run here (None: the current stream)
        self._partial: dict[str, torch.Tensor] = {}
        self._frames: dict[str, torch.Tensor] = {}  # full-shaped tensors whose part is being written

    def copy(self, piece: Piece, slot: torch.Tensor, non_blocking: bool = False) -> torch.Tensor | None:
        item = piece.item
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            dest = self._partial.pop(item.name, None) if piece.offset else None
            if dest is None:
                dest = self._allocate(item)
            if not item.read_in_place:  # (landed: the reader put the bytes in place)
                self._write(dest, piece, slot[piece.slot_offset : piece.slot_offset + piece.length], non_blocking)
            if not piece.last:
                self._partial[item.name] = dest
                return None
            if item.read_whole:  # the whole tensor was read: keep this rank's part, owned and contiguous
                assert item.part is not None
                if item.full_shape:
                    return dest.to(item.out)
                part = dest.narrow(item.part.dim, item.part.start, item.part.length)
                if item.into is not None:
                    return item.into.copy_(part)
                dest = part.to(item.out, copy=True, memory_format=torch.contiguous_format)
            elif item.full_shape:
                dest = self._framed(item, dest)
            elif item.into is not None and dest is not item.into:  # a destination we could not write piecewise
                dest = item.into.copy_(dest)
        return dest

    def _framed(self, item: Item, part: torch.Tensor) -> torch.Tensor:
        """The full-shaped tensor holding `part` (`ShardSpec.full_shape`)."""
        full = self._frames.pop(item.name, None)
        if full is None:
            assert item.part is not None
            full = torch.empty(_full_shape(item), dtype=item.out, device=self.device)
            full.narrow(item.part.dim, item.part.start, item.part.length).copy_(part)
        return full

    def _allocate(self, item: Item) -> torch.Tensor:
        if item.full_shape and not item.read_whole:
            assert item.part is not None
            full = torch.empty(_full_shape(item), dtype=item.out, device=self.device)
            part = full.narrow(item.part.dim, item.part.start, item.part.length)
            if part.is_contiguous():  # rows of it: the slot's bytes go straight into place
                self._frames[item.name] = full
                return part
        if item.into is not None and item.into.is_contiguous() and not item.read_whole:
            return item.into  # in place: the slot's bytes go straight into the destination
        if item.read_whole:
            return torch.empty(_full_shape(item), dtype=item.stored, device=self.device)
        return torch.empty(item.shape, dtype=item.out if item.into is None else item.stored, device=self.device)

    @staticmethod
    def _write(dest: torch.Tensor, piece: Piece, src: torch.Tensor, non_blocking: bool) -> None:
        item = piece.item
        if piece.length:
            if dest.dtype == item.stored:
                # The piece's bytes of `dest`, counted from its own first byte: it may view a larger
                # storage (a rank's rows of a fused parameter).
                at = dest.storage_offset() * dest.element_size() + piece.offset
                into = torch.empty(0, dtype=torch.uint8, device=dest.device)
                into.set_(dest.untyped_storage(), at, (piece.length,), (1,))
                if piece.length <= _SMALL_COPY and into.device.type == src.device.type == "cpu" and src.is_contiguous():
                    _memmove_holding_gil(into.data_ptr(), src.data_ptr(), piece.length)
                else:
                    into.copy_(src, non_blocking=non_blocking)
            else:
                size = item.stored.itemsize
                first = piece.offset // size
                dest.view(-1)[first : first + piece.length // size].copy_(
                    src.view(item.stored), non_blocking=non_blocking
                )

    def clear(self) -> None:
        self._partial.clear()
        self._frames.clear()


def _full_shape(item: Item) -> tuple[int, ...]:
    shape = torch_shape(item.info.dtype, item.info.shape)
    assert shape is not None  # the plan only admits tensors torch can hold
    return shape


def convert(t: torch.Tensor, item: Item) -> torch.Tensor:
    """`t` (the stored bytes) as delivered: into the item's destination, or converted to its dtype."""
    if item.into is not None:
        return item.into.copy_(t)
    return t if item.out == item.stored else t.to(item.out)
