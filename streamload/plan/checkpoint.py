"""A checkpoint: its files' validated headers, every tensor by name, and the storage that holds them
(which files a source names is the storage's business: storage/)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePath
from typing import NamedTuple

from streamload.base import argument_checks
from streamload.base.errors import SourceError
from streamload.base.gc_pause import collector_paused
from streamload.format.header import FileHeader, TensorInfo
from streamload.integrity.digests import Known
from streamload.storage import LocalStorage, PathLike, Source, Storage, storage_for


class Checkpoint(NamedTuple):
    """The files of a checkpoint with their validated headers, and every tensor by name."""

    files: tuple[FileHeader, ...]
    tensors: dict[str, TensorInfo]
    index_metadata: dict[str, object] | None = None
    storage: Storage = LocalStorage()
    checks: Mapping[PurePath, Known] = {}  # what the integrity layer checks of
    # files that are not the origin's (a cache's copies), whatever `verify=` says

    def __repr__(self) -> str:
        return f"Checkpoint({len(self.files)} files, {len(self.tensors)} tensors, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def metadata(self) -> dict[str, str]:
        """The files' `__metadata__`, merged in file order."""
        merged: dict[str, str] = {}
        for f in self.files:
            merged.update(f.metadata or {})
        return merged


@collector_paused
def open_checkpoint(source: Source | Checkpoint, cache_dir: PathLike | None = None) -> Checkpoint:
    """Find the files of `source` and read every header (no tensor data is read). With `cache_dir`,
    a remote checkpoint whose every file the cache holds at its current version is read from there.
    A `Checkpoint` (from `inspect`) is its own answer: loads of parts of it read no header again."""
    if isinstance(source, Checkpoint):
        return source
    argument_checks.source(source)
    argument_checks.path(cache_dir, "cache_dir")
    storage = storage_for(source, cache_dir)
    listing = storage.locate(source)
    if storage.local or len(listing.files) < 2:
        headers = tuple(storage.header(p) for p in listing.files)
    else:
        with ThreadPoolExecutor(min(16, len(listing.files))) as pool:  # one round trip per object, all at once
            headers = tuple(pool.map(storage.header, listing.files))
    copies = storage.cached(headers)
    checks: Mapping[PurePath, Known] = {}
    if copies is not None:
        local = tuple(LocalStorage().header(p) for p in copies.paths)
        if copies.identities is None or [h.identity for h in local] == copies.identities:  # the copies judged
            storage, checks, headers = LocalStorage(), copies.checks, local
    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in tensors:
                raise SourceError(f"tensor {t.name!r} appears in both {tensors[t.name].path} and {h.path}")
            tensors[t.name] = t
    if listing.weight_map is not None:
        if not listing.weight_map:  # as include= that selects nothing: said, not an empty state dict in silence
            warnings.warn(f"streamload: {listing.index}: its weight_map is empty: no tensor to load", stacklevel=3)
        for name, shard in listing.weight_map.items():
            where = tensors.get(name)
            if where is None or where.path.name != shard:
                raise SourceError(f"{listing.index}: tensor {name!r} is mapped to {shard}, which does not hold it")
    return Checkpoint(headers, tensors, listing.index_metadata, storage, checks)


def merged(parts: Mapping[str, Checkpoint]) -> Checkpoint:
    """Several checkpoints as one, each tensor named `part.name` (a pipeline's components: one load,
    one ring, one reader pool for all of them). Every part must be in the same storage (bucket, host)."""
    storages = {(type(c.storage), getattr(c.storage, "root", None)) for c in parts.values()}
    if len(storages) > 1:
        raise SourceError(f"cannot load checkpoints from different kinds of storage together: {', '.join(parts)}")
    files: list[FileHeader] = []
    tensors: dict[str, TensorInfo] = {}
    for prefix, checkpoint in parts.items():
        files += checkpoint.files
        tensors.update((f"{prefix}.{n}", t._replace(name=f"{prefix}.{n}")) for n, t in checkpoint.tensors.items())
    storage = next(iter(parts.values())).storage if parts else LocalStorage()
    checks = {path: known for c in parts.values() for path, known in c.checks.items()}
    return Checkpoint(tuple(files), tensors, None, storage, checks)


__all__ = ["Checkpoint", "PathLike", "Source", "merged", "open_checkpoint"]
