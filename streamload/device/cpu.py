"""CPU devices: staged (slots in host memory, each tensor copied out into its own allocation) and
mapped (each tensor a view of a private read-only file mapping, as `safetensors.torch.load_file` does)."""

from __future__ import annotations

import torch

from streamload.base.page_release import Release
from streamload.base.tuning import HOST_STAGING
from streamload.device.base import Assembler, Delivered, Device, DeviceKind, HostRing, Into, convert
from streamload.format.dtypes import torch_shape
from streamload.format.header import TensorInfo
from streamload.plan.plan import Batch, Item
from streamload.storage import Files, LocalFiles


class CPUKind(DeviceKind):
    """The host: no streams, no pinning; bytes staged in host slots, or viewed in file mappings."""

    type = "cpu"
    host_memory = True
    lands = ("host", "mapped")
    staging = HOST_STAGING
    collective_backend = "gloo"
    examples = ("'cpu'",)

    def staging_device(self, dev: torch.device, into: Into) -> Device:
        return MappedCPU() if into == "mapped" else StagedCPU()


class StagedCPU:
    """Slots are host tensors; each tensor is copied out of its slot into its own allocation."""

    name = "cpu"
    staged = True
    buffers = 0
    padding = 0

    def __init__(self) -> None:
        self._assembler = Assembler(torch.device("cpu"))
        self._ring = HostRing()

    def new_slot(self, nbytes: int) -> torch.Tensor:
        return self._ring.new_slot(nbytes)

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: Files) -> list[Delivered]:
        assert slot is not None
        out = []
        for piece in batch.pieces:
            t = self._assembler.copy(piece, slot)
            if t is not None:
                out.append((piece.item.name, t))
        return out

    def close(self) -> None:
        self._assembler.clear()
        self._ring.close()


class MappedCPU:
    """Tensors are views of MAP_PRIVATE file mappings: no copy, and writes to them never reach the file.

    A tensor keeps its file's mapping alive; a dtype conversion makes an ordinary allocation instead.
    """

    name = "cpu"
    staged = False
    buffers = 0
    padding = 0
    keep_pages = False  # True where each batch's bytes are hashed after it is made (verify=): none leave

    def __init__(self) -> None:
        self._release = Release()

    def new_slot(self, nbytes: int) -> None:
        return None

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: LocalFiles) -> list[Delivered]:
        maps = _Mappings(files)  # a batch's tensors come from a few files: each mapping looked up once
        out = []
        for piece in batch.pieces:
            if not piece.last:
                continue
            view = _view(piece.item, maps)
            t = convert(view, piece.item)
            if t is not view and piece.item.part is None and not self.keep_pages:
                # Copied (into its destination, or converted): its file pages leave the process now,
                # not when the file's mapping closes, so a load into a model holds about a batch of
                # them rather than a shard (the page cache keeps them; a copy the format's alignment
                # made is no mapping's, and left alone).
                self._release(view)
            out.append((piece.item.name, t))
        return out

    def close(self) -> None:
        pass


class _Mappings(dict):  # type: ignore[type-arg]
    """path -> its mapping, asked of `files` once (hashing a path costs microseconds, per tensor)."""

    def __init__(self, files: LocalFiles) -> None:
        super().__init__()
        self.files = files

    def __missing__(self, path: object) -> torch.UntypedStorage:
        storage = self[path] = self.files.mapping(path)  # type: ignore[arg-type]
        return storage


def _view(item: Item, files: _Mappings) -> torch.Tensor:
    info = item.info
    shape = torch_shape(info.dtype, info.shape)
    assert shape is not None  # the plan only admits tensors torch can hold
    full = _mapped(info, item.stored, shape, files)
    if item.part is None:
        return full
    # A rank's slice: copied out of the full tensor's view, which reads only the slice's pages
    # (in place: `convert` copies it straight into the destination).
    part = full.narrow(item.part.dim, item.part.start, item.part.length)
    if item.full_shape:  # the mapping itself, of which only the part's pages were read
        if item.out == item.stored:
            return full
        framed = torch.empty(shape, dtype=item.out)
        framed.narrow(item.part.dim, item.part.start, item.part.length).copy_(part)
        return framed
    return part if item.into is not None else part.clone()


def _mapped(info: TensorInfo, dtype: torch.dtype, shape: tuple[int, ...], files: _Mappings) -> torch.Tensor:
    if info.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    storage = files[info.path]
    size = dtype.itemsize
    if info.begin % size:  # the format does not promise alignment: copy such a tensor out
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, info.begin, (info.nbytes,), (1,))
        return raw.clone().view(dtype).reshape(shape)
    return torch.empty(0, dtype=dtype).set_(storage, info.begin // size, shape)  # contiguous strides
