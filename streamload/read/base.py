"""What every reader shares: open files, contiguous spans of a batch, and the job type."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from ..errors import ReadError
from ..format import FileHeader, file_identity, open_regular
from ..plan import Batch

Job = Callable[[], int]  # blocking; runs on a reader thread; returns the bytes it brought in


class Reader(Protocol):
    name: str

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: OpenFiles) -> list[Job]:
        """Blocking jobs that, once all have run, leave the batch's bytes in `slot` (or resident)."""
        ...

    def close(self) -> None:
        """Release what the reader opened (called once the last job has returned)."""
        ...


class OpenFiles:
    """File descriptors (and, on demand, private read-only mappings) of the files a plan reads.

    Closing drops the descriptors; a mapping stays alive as long as a tensor viewing it does.
    """

    def __init__(self, headers: dict[Path, FileHeader]) -> None:
        self._headers = headers
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, torch.UntypedStorage] = {}
        self._direct: dict[Path, int | None] = {}
        self._lock = threading.Lock()
        try:
            for path, header in headers.items():
                self._fds[path] = fd = open_regular(path)
                st = os.fstat(fd)
                if st.st_size != header.size:
                    raise ReadError(f"{path}: file is now {st.st_size} bytes, not the {header.size} its header said")
                if header.identity and file_identity(st) != header.identity:
                    raise ReadError(f"{path}: file was replaced or modified after its header was read")
        except BaseException:
            self.close()
            raise

    def fd(self, path: Path) -> int:
        return self._fds[path]

    def mapping(self, path: Path) -> torch.UntypedStorage:
        with self._lock:
            storage = self._maps.get(path)
            if storage is None:
                # shared=False: MAP_PRIVATE, so writes to a tensor never reach the file (copy on write).
                # Mapped through our descriptor, not the name: the very file whose header was read.
                name = f"/proc/self/fd/{self._fds[path]}"
                if not os.path.exists(name):  # no /proc: the name it is
                    name = str(path)
                size = self._headers[path].size
                storage = torch.UntypedStorage.from_file(name, shared=False, nbytes=size)
                self._maps[path] = storage
            return storage

    def direct_fd(self, path: Path) -> int | None:
        """The same file opened again with O_DIRECT (through our descriptor, so the very file whose
        header was read), or None where the file system does not allow it."""
        with self._lock:
            if path not in self._direct:
                self._direct[path] = self._open_direct(path)
            return self._direct[path]

    def _open_direct(self, path: Path) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        name = f"/proc/self/fd/{self._fds[path]}"
        if not flag or not os.path.exists(name):
            return None
        try:
            fd = os.open(name, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # EINVAL: tmpfs and others refuse O_DIRECT
            return None
        if file_identity(os.fstat(fd)) != file_identity(os.fstat(self._fds[path])):
            os.close(fd)
            raise ReadError(f"{path}: file was replaced or modified after its header was read")
        return fd

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        direct, self._direct = self._direct, {}
        self._maps = {}
        for fd in [*fds.values(), *direct.values()]:
            if fd is not None:
                os.close(fd)


class Span(NamedTuple):
    """Bytes contiguous in one file, scattered to `parts` = [(slot_offset, length)] in order."""

    path: Path
    file_offset: int
    parts: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def end(self) -> int:
        return self.file_offset + self.length


def spans(batch: Batch, chunk_bytes: int) -> Iterable[Span]:
    """The batch's byte ranges, merged where contiguous in a file and cut to at most `chunk_bytes`,
    so that one large tensor is read by several threads at once."""
    path: Path | None = None
    start = end = 0
    parts: list[tuple[int, int]] = []
    for p in batch.pieces:
        if p.length == 0:
            continue
        info = p.item.info
        if parts and (info.path != path or p.file_offset != end or end - start + p.length > chunk_bytes):
            yield from _cut(Span(path, start, tuple(parts)), chunk_bytes)  # type: ignore[arg-type]
            parts = []
        if not parts:
            path, start, end = info.path, p.file_offset, p.file_offset
        parts.append((p.slot_offset, p.length))
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


def _cut(span: Span, chunk_bytes: int) -> Iterable[Span]:
    if span.length <= chunk_bytes:
        yield span
        return
    file_offset = span.file_offset
    for slot_offset, length in span.parts:
        for at in range(0, length, chunk_bytes):
            n = min(chunk_bytes, length - at)
            yield Span(span.path, file_offset + at, ((slot_offset + at, n),))
        file_offset += length


def read_error(path: Path, offset: int, why: str) -> ReadError:
    return ReadError(f"{path}: reading at offset {offset} failed: {why}")


def eof_error(path: Path, offset: int) -> ReadError:
    return read_error(path, offset, "unexpected end of file (truncated since its header was read?)")


def writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous host tensor's bytes (without needing numpy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
