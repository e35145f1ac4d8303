"""CPU devices: staged (slots in host memory, each tensor copied out into its own allocation) and
mapped (each tensor a view of a private read-only file mapping, as `safetensors.torch.load_file` does)."""

from __future__ import annotations

import torch

from ..plan import Batch, Item
from ..read import OpenFiles
from .base import Assembler, Delivered, convert


class StagedCPU:
    """Slots are host tensors; each tensor is copied out of its slot into its own allocation."""

    name = "cpu"
    staged = True

    def __init__(self) -> None:
        self._assembler = Assembler(torch.device("cpu"))

    def new_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def cheap(self, batch: Batch) -> bool:
        return False  # copies every byte

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: OpenFiles) -> list[Delivered]:
        assert slot is not None
        out = []
        for piece in batch.pieces:
            t = self._assembler.copy(piece, slot)
            if t is not None:
                out.append((piece.item.name, t))
        return out

    def close(self) -> None:
        self._assembler.clear()


class MappedCPU:
    """Tensors are views of MAP_PRIVATE file mappings: no copy, and writes to them never reach the file.

    A tensor keeps its file's mapping alive; a dtype conversion makes an ordinary allocation instead.
    """

    name = "cpu"
    staged = False

    def new_slot(self, nbytes: int) -> None:
        return None

    def cheap(self, batch: Batch) -> bool:
        return all(p.item.out == p.item.stored for p in batch.pieces)  # views only, no conversion

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: OpenFiles) -> list[Delivered]:
        return [(p.item.name, convert(_view(p.item, files), p.item)) for p in batch.pieces if p.last]

    def close(self) -> None:
        pass


def _view(item: Item, files: OpenFiles) -> torch.Tensor:
    info = item.info
    if info.nbytes == 0:
        return torch.empty(item.shape, dtype=item.stored)
    storage = files.mapping(info.path)
    size = item.stored.itemsize
    if info.begin % size:  # the format does not promise alignment: copy such a tensor out
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, info.begin, (info.nbytes,), (1,))
        return raw.clone().view(item.stored).reshape(item.shape)
    return torch.empty(0, dtype=item.stored).set_(storage, info.begin // size, item.shape, _strides(item.shape))


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for dim in reversed(shape):
        out.append(step)
        step *= max(dim, 1)
    return tuple(reversed(out))
