"""Which reader and device serve a load: one table row per reader, and the device's kind, no other branching.

A reader row says whether it reads local files by descriptor or ranges through the storage (asking
the storage's capability `Storage.local`, never which storage it is), where its bytes land ("host":
staging slots in host memory; "mapped": the page cache, viewed in place; "device": GPU slots), and
how it is built; a device kind says where bytes may land for it (`DeviceKind.lands`) and builds the
device that makes them tensors. `reader="auto"` takes the first row, in table order, that fits and
whose builder accepts the load; a named reader is checked against its row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import PurePath
from typing import Literal, NamedTuple

import torch

from streamload.base.errors import UnsupportedError
from streamload.base.tuning import Tuning, available_memory
from streamload.device import Device, DeviceKind, Into, kind_of
from streamload.read import DirectReader, MmapReader, PosixReader, Reader

ReaderName = Literal["auto", "mmap", "posix", "direct", "kvikio", "range"]
log = logging.getLogger("streamload")
WHERE: dict[Into, str] = {"host": "host staging slots", "mapped": "file mappings", "device": "device memory"}


class Load(NamedTuple):
    """What a builder may look at."""

    device: torch.device
    tuning: Tuning
    first_file: PurePath | None
    total_bytes: int
    chosen: bool  # named by the caller (a builder raises) rather than tried by auto (it returns None)
    copies: bool = False  # most bytes are copied into tensors that exist already (into=)


class ReaderRow(NamedTuple):
    name: str
    local: bool  # reads a local storage's files (else a remote storage's ranges: `Files.read`)
    into: Into  # it serves the devices whose kind takes bytes landing here
    build: Callable[[Load], Reader | None]


def _kvikio(load: Load) -> Reader | None:
    """kvikio where it can use GPUDirect Storage (auto), or whenever named; in its POSIX mode it
    bounces through host memory just as the posix row's pinned path does."""
    try:
        from streamload.read.kvikio import KvikioReader

        kv = KvikioReader(load.tuning.threads, load.tuning.chunk_bytes)
    except UnsupportedError as exc:
        if load.chosen:
            raise
        log.warning("streamload: kvikio is unavailable (%s); reading with preadv into pinned memory", exc)
        return None
    if not (load.chosen or kv.gds):
        kv.close()
        return None
    if load.first_file is not None:
        try:
            kv.probe(load.first_file, load.device)
        except UnsupportedError as exc:  # GDS reported, but cuFile cannot read this file (tmpfs, its config)
            kv.close()
            if load.chosen:
                raise
            log.warning("streamload: %s; reading with preadv into pinned memory instead", exc)
            return None
    return kv


def _mmap(load: Load) -> Reader | None:
    """On the CPU, mapping wins (measured, docs/benchmarks.md): tensors are views of the page cache.
    Not under auto where the bytes are copied into tensors of their own anyway: the mapped pages
    would hold the checkpoint in the process a second time until the load ends."""
    return None if load.copies and not load.chosen else MmapReader(load.tuning.chunk_bytes)


def _direct(load: Load) -> Reader | None:
    """O_DIRECT: under auto only for a checkpoint larger than the memory available, whose pages the
    page cache could not keep anyway (where it can, buffered reads measured faster)."""
    memory = available_memory()
    if load.chosen or (memory is not None and load.total_bytes > memory):
        return DirectReader(load.tuning.chunk_bytes)
    return None


def _range(load: Load) -> Reader:
    from streamload.read.ranges import RangeReader

    return RangeReader(load.tuning.chunk_bytes)


READERS: tuple[ReaderRow, ...] = (
    ReaderRow("kvikio", True, "device", _kvikio),
    ReaderRow("mmap", True, "mapped", _mmap),
    ReaderRow("direct", True, "host", _direct),
    ReaderRow("posix", True, "host", lambda load: PosixReader(load.tuning.chunk_bytes)),
    ReaderRow("range", False, "host", _range),
)


def _storage(local: bool) -> str:
    """A storage as messages name it, by its capability."""
    return "local" if local else "object"


def usable(dev: torch.device) -> torch.device:
    """`dev`, where a load can put tensors here; else one line saying why."""
    kind = kind_of(dev)
    if not kind.available():
        raise UnsupportedError(f"device {dev}: {kind.missing}")
    return dev


def route(
    dev: torch.device,
    reader: str,
    local: bool,
    tuning: Tuning,
    first_file: PurePath | None = None,
    total_bytes: int = 0,
    lands: Collection[Into] = ("host", "mapped", "device"),
    why: str = "",
    copies: bool = False,
) -> tuple[Reader, Device]:
    """The reader and device for a load of a storage that is `local` or not (`Storage.local`). `lands`: where
    the load needs the bytes to land, and `why` (ranks exchanging host slots, or hashing, need host memory)."""
    names = [r.name for r in READERS]
    if reader != "auto" and reader not in names:
        raise ValueError(f"reader must be 'auto' or one of {', '.join(repr(n) for n in names)}, not {reader!r}")
    kind = kind_of(usable(dev))
    chosen = reader != "auto"
    load = Load(dev, tuning, first_file, total_bytes, chosen, copies)
    for row in READERS:
        if chosen and row.name != reader:
            continue
        fits = _fits(row, dev, kind, local, lands, why)
        if fits is not None:
            if chosen:
                raise UnsupportedError(fits)
            continue
        built = row.build(load)
        if built is not None:
            return built, kind.staging_device(dev, row.into)
    raise UnsupportedError(f"no reader reads {_storage(local)} storage into {dev}")  # the table lacks a row


def _fits(
    row: ReaderRow, dev: torch.device, kind: DeviceKind, local: bool, lands: Collection[Into], why: str
) -> str | None:
    """None if the row serves this load, else why not (the error for a reader named by the caller)."""
    others = ", ".join(repr(r.name) for r in READERS if r.local == local and r.into in kind.lands)
    if row.local != local:
        return f"the {row.name} reader reads {_storage(row.local)} storage, not {_storage(local)}: use {others}"
    if row.into not in kind.lands:
        return f"the {row.name} reader reads into {WHERE[row.into]}, which {dev.type} does not take: use {others}"
    if row.into not in lands:
        fit = ", ".join(repr(r.name) for r in READERS if r.into in lands and r.local == local)
        return f"{why}: use a reader that does ({fit}), not {row.name!r}"
    return None
