"""Ranged GETs of objects (S3, HTTP) into host slots: one request per span, run on reader threads."""

from __future__ import annotations

import functools

import torch

from ..plan import Batch
from ..storage.remote import ObjectFiles
from .base import Job, Span, spans, writable_bytes


class RangeReader:
    """Each span of a batch (contiguous bytes of one object, at most `chunk_bytes`) is one ranged GET
    whose body is copied to its places in the slot; requests in flight are as many as reader threads."""

    name = "range"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: ObjectFiles) -> list[Job]:
        assert slot is not None
        view = writable_bytes(slot)
        return [functools.partial(_get_span, files, span, view) for span in spans(batch, self.chunk_bytes)]

    def close(self) -> None:
        pass


def _get_span(files: ObjectFiles, span: Span, view: memoryview) -> int:
    data = files.read(span.path, span.file_offset, span.length)
    at = 0
    for slot_offset, n in span.parts:
        view[slot_offset : slot_offset + n] = data[at : at + n]
        at += n
    return span.length
