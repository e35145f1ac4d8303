"""The mapping reader: makes a batch's bytes resident in a private read-only file mapping.

On a warm page cache this costs no copy at all (the pages are mapped, not copied), which is why the
CPU path prefers it; on a cold cache several threads fault in disjoint ranges at once.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..plan import Batch
from .base import Job, OpenFiles, Span, read_error, spans

_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault pages in without touching them from user space
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc: fall back to touching pages
    _madvise = None


class MmapReader:
    name = "mmap"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: OpenFiles) -> list[Job]:
        return [functools.partial(_populate, files.mapping(s.path), s) for s in spans(batch, self.chunk_bytes)]


def _populate(mapping: torch.UntypedStorage, span: Span) -> int:
    base = mapping.data_ptr()
    start = base + span.file_offset
    end = start + span.length
    aligned = start - start % _PAGE
    if _madvise is not None and _madvise(aligned, end - aligned, _MADV_POPULATE_READ) == 0:
        return span.length
    err = ctypes.get_errno() if _madvise is not None else 0
    if err in (14, 12):  # EFAULT / ENOMEM: the range is past the file's end now
        raise read_error(span.path, span.file_offset, "file is shorter than its header says (truncated?)")
    if err not in (0, 22, 38):  # not EINVAL/ENOSYS (old kernel): a real I/O error
        raise read_error(span.path, span.file_offset, os.strerror(err))
    _touch(mapping, span)
    return span.length


def _touch(mapping: torch.UntypedStorage, span: Span) -> None:
    raw = torch.empty(0, dtype=torch.uint8).set_(mapping)
    raw[span.file_offset : span.file_offset + span.length : _PAGE].sum()
