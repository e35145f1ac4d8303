"""The POSIX reader: parallel `preadv` into a staging slot (the GIL is released during the syscall)."""

from __future__ import annotations

import functools
import os
import time

import torch

from ..plan import Batch
from .base import Job, OpenFiles, Span, eof_error, read_error, span_groups, writable_bytes

_RETRIES = 100  # EINTR/EAGAIN in a row before a read is given up
_BACKOFF = 0.001  # seconds, times the retries so far (up to 10)


class PosixReader:
    name = "posix"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def close(self) -> None:
        pass

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: OpenFiles) -> list[Job]:
        assert slot is not None, "the posix reader reads into a staging slot"
        view = writable_bytes(slot)
        return [
            functools.partial(_read_spans, files.fd(g[0].path), g, view) for g in span_groups(batch, self.chunk_bytes)
        ]


def _read_spans(fd: int, group: list[Span], slot: memoryview) -> int:
    return sum(_read_span(fd, span, slot) for span in group)


def _read_span(fd: int, span: Span, slot: memoryview) -> int:
    buffers = [slot[at : at + n] for at, n in span.parts]
    offset, done, total = span.file_offset, 0, span.length
    retries = 0
    while done < total:
        try:
            n = os.preadv(fd, buffers, offset)
        except (InterruptedError, BlockingIOError) as exc:  # EINTR, EAGAIN: transient, but not forever
            retries += 1
            if retries > _RETRIES:
                raise read_error(span.path, offset, f"{exc.strerror or exc} ({_RETRIES} times in a row)") from exc
            time.sleep(_BACKOFF * min(retries, 10))
            continue
        except OSError as exc:
            raise read_error(span.path, offset, exc.strerror or str(exc)) from exc
        retries = 0
        if n == 0:
            raise eof_error(span.path, offset)
        done += n
        offset += n
        buffers = _advance(buffers, n)
    return total


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first `n` bytes of a scatter list after a short read."""
    while n and buffers:
        first = buffers[0]
        if n >= len(first):
            n -= len(first)
            buffers = buffers[1:]
        else:
            buffers = [first[n:], *buffers[1:]]
            n = 0
    return buffers
