"""What every reader shares: the protocol, contiguous spans of a batch, and the job type."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath
from typing import Any, NamedTuple, Protocol

import torch

from streamload.base.errors import ReadError
from streamload.plan.plan import Batch

Job = Callable[[], int]  # blocking; runs on a reader thread; returns the bytes it brought in
Work = Job | int  # a job, or the length of a range already in place (resident pages): nothing to run


class Reader(Protocol):
    name: str

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> Sequence[Work]:
        """Blocking jobs that, once all have run, leave the batch's bytes in `slot` (or resident).
        `files` is what the storage this reader serves opened (storage/: LocalFiles, ObjectFiles)."""

    def close(self) -> None:
        """Release what the reader opened (called once the last job has returned)."""


class ChunkedReader:
    """A reader whose requests ask at most `chunk_bytes`, with nothing of its own to release."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def close(self) -> None:
        pass


Where = int | memoryview  # a slot offset, or (`Item.read_in_place`) the destination's own bytes


class Span(NamedTuple):
    """Bytes contiguous in one file, scattered to `parts` = [(where, length)] in order: `where` is an
    offset in the slot, or the bytes of the tensor they land in (only for readers that land them)."""

    path: PurePath
    file_offset: int
    parts: tuple[tuple[Where, int], ...]

    def buffers(self, slot: memoryview) -> list[memoryview]:
        return [slot[at : at + n] if isinstance(at, int) else at for at, n in self.parts]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def end(self) -> int:
        return self.file_offset + self.length


def spans(batch: Batch, chunk_bytes: int) -> Iterable[Span]:
    """The batch's byte ranges, merged where contiguous in a file and cut to at most `chunk_bytes`,
    so that one large tensor is read by several threads at once."""
    path: PurePath | None = None
    start = end = 0
    parts: list[tuple[Where, int]] = []
    for p in batch.pieces:
        if p.length == 0:
            continue
        info = p.item.info
        if parts and (info.path != path or p.file_offset != end or end - start + p.length > chunk_bytes):
            yield from _cut(Span(path, start, tuple(parts)), chunk_bytes)  # type: ignore[arg-type]
            parts = []
        if not parts:
            path, start, end = info.path, p.file_offset, p.file_offset
        at: Where = p.slot_offset
        if p.item.read_in_place:  # the destination's own bytes
            at = writable_bytes(p.item.into)[p.offset : p.offset + p.length]  # type: ignore[arg-type]
        parts.append((at, p.length))
        end += p.length
    if parts:
        yield from _cut(Span(path, start, tuple(parts)), chunk_bytes)  # type: ignore[arg-type]


def span_groups(batch: Batch, chunk_bytes: int) -> list[list[Span]]:
    """`spans`, gathered into runs of one file of up to `chunk_bytes` together: one job each, so that
    thousands of small ranges (a rank's columns of a row-split tensor) cost few thread hops."""
    groups: list[list[Span]] = []
    size = 0
    for span in spans(batch, chunk_bytes):
        if not groups or groups[-1][0].path != span.path or size + span.length > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(span)
        size += span.length
    return groups


def extents(group: list[Span]) -> list[tuple[int, int]]:
    """The file ranges (start, end) a group of spans of one file covers, in file order, touching ones
    merged. A group is in plan order, which need not be file order (layer 9 then layer 10 of a file that
    stores `layers.10` first), so its first span's start and last span's end do not bound it."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((s.file_offset, s.end) for s in group):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _cut(span: Span, chunk_bytes: int) -> Iterable[Span]:
    if span.length <= chunk_bytes:
        yield span
        return
    file_offset = span.file_offset
    for where, length in span.parts:
        for at in range(0, length, chunk_bytes):
            n = min(chunk_bytes, length - at)
            yield Span(
                span.path, file_offset + at, ((where + at if isinstance(where, int) else where[at : at + n], n),)
            )
        file_offset += length


def read_error(path: PurePath, offset: int, why: str) -> ReadError:
    return ReadError(f"{path}: reading at offset {offset} failed: {why}")


def eof_error(path: PurePath, offset: int) -> ReadError:
    return read_error(path, offset, "unexpected end of file (truncated since its header was read?)")


def writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous host tensor's bytes (without needing numpy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
