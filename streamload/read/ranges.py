"""Ranged GETs of objects (S3, HTTP) into host slots: a span per reader thread, in ranges paced by the store."""

from __future__ import annotations

import functools

import torch

from streamload.plan.plan import Batch
from streamload.read.base import ChunkedReader, Job, Span, spans, writable_bytes
from streamload.storage.remote import ObjectFiles


class RangeReader(ChunkedReader):
    """Each span of a batch (contiguous bytes of one object, at most `chunk_bytes`) is read by one reader
    thread as ranged GETs of the store's request size, all at once, whose bodies are copied to their
    places in the slot; how many requests are in flight is the store's pace (storage/pace.py)."""

    name = "range"

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: ObjectFiles) -> list[Job]:
        assert slot is not None
        view = writable_bytes(slot)
        return [functools.partial(_get_span, files, span, view) for span in spans(batch, self.chunk_bytes)]


def _get_span(files: ObjectFiles, span: Span, view: memoryview) -> int:
    """The span's bytes, which come as consecutive ranges, copied to its places in the slot."""
    ranges = iter(files.read(span.path, span.file_offset, span.length))
    data, at = next(ranges), 0
    for slot_offset, n in span.parts:
        while n:
            if at == len(data):
                data, at = next(ranges), 0
            k = min(n, len(data) - at)
            view[slot_offset : slot_offset + k] = data[at : at + k]
            slot_offset, at, n = slot_offset + k, at + k, n - k
    return span.length
