"""The mapping reader: makes a batch's bytes resident in a private read-only file mapping.

Reader threads map each range not wholly in the page cache into the page tables with
MADV_POPULATE_READ (no copy: the pages are the page cache's) after readahead of the whole range; it
reports an I/O error or a truncated file as an error code, not SIGBUS. A range wholly cached (one
`cachestat` as the batch is planned: ~7 us per 8 MiB) gets no job: the consumer's page faults map it
without I/O, so none can fail. Mapping those on threads measured no faster alone (255 ms against 259 ms,
2 GB warm) and slower inside vLLM, whose copies into the parameters lose cores to them (0.66 s against
0.70-0.72 s); and a warm load that hands out no job starts no thread (~0.5 ms each).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from streamload.base.page_release import PAGE, madvise
from streamload.plan.plan import Batch
from streamload.read.base import ChunkedReader, Span, Work, extents, read_error, span_groups
from streamload.read.resident import resident
from streamload.storage import LocalFiles

_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault pages in without touching them from user space


class MmapReader(ChunkedReader):
    name = "mmap"

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: LocalFiles) -> list[Work]:
        work: list[Work] = []
        for group in span_groups(batch, self.chunk_bytes):
            fd = files.fd(group[0].path)
            if all(resident(fd, start, end - start) for start, end in extents(group)):
                work.append(sum(span.length for span in group))  # left to the consumer's faults
            else:
                work.append(functools.partial(_populate, fd, files.mapping(group[0].path), group))
        return work


def _populate(fd: int, mapping: torch.UntypedStorage, group: list[Span]) -> int:
    for span in group:
        # Start readahead of the whole range at once (a deep queue), then wait for it page by page.
        try:
            os.posix_fadvise(fd, span.file_offset, span.length, os.POSIX_FADV_WILLNEED)
        except OSError as exc:
            raise read_error(span.path, span.file_offset, exc.strerror or str(exc)) from exc
        start = mapping.data_ptr() + span.file_offset
        aligned = start - start % PAGE
        if madvise is not None and madvise(aligned, start + span.length - aligned, _MADV_POPULATE_READ) == 0:
            continue
        err = ctypes.get_errno() if madvise is not None else 0
        if err in (14, 12):  # EFAULT / ENOMEM: the range is past the file's end now
            raise read_error(span.path, span.file_offset, "file is shorter than its header says (truncated?)")
        if err not in (0, 22, 38):  # not EINVAL/ENOSYS (old kernel): a real I/O error
            raise read_error(span.path, span.file_offset, os.strerror(err))
        raw = torch.empty(0, dtype=torch.uint8).set_(mapping)  # touched a page at a time instead
        raw[span.file_offset : span.file_offset + span.length : PAGE].sum()
    return sum(span.length for span in group)
