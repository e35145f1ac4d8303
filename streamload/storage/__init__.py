"""Where checkpoints live. One module per kind of storage; `STORAGES` maps a source's URL scheme to
the storage that serves it (a plain path is local). A new storage: a module with a class that meets
`base.Storage`, a row here, and a reader in `read/` that declares it serves the storage's `kind`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from streamload.storage.base import INDEX_NAME, Digest, Files, Listing, PathLike, Source, Storage, is_hex, redacted
from streamload.storage.hub import hub_id
from streamload.storage.local import LocalFiles, LocalStorage


def _objects(root: str, cache_dir: Path | None) -> Storage:
    from streamload.storage.remote import ObjectStorage  # obstore is imported only for URLs

    return ObjectStorage(root, cache_dir)


def _hub(root: str, cache_dir: Path | None) -> Storage:
    from streamload.storage.hub import HubStorage  # huggingface_hub is imported only for hub ids

    return HubStorage(cache_dir)


STORAGES: dict[str, Callable[[str, Path | None], Storage]] = {"s3": _objects, "http": _objects, "https": _objects,
                                                               "hf": _hub}  # fmt: skip


def storage_for(source: Source, cache_dir: PathLike | None = None) -> Storage:
    """The storage that holds `source`: by its URL scheme (s3://, http(s)://, hf://), a Hugging Face hub id
    (`org/name[@revision]` where no local path has that name: storage/hub.py), else the local one.
    `cache_dir`: where a remote storage keeps local copies of what it reads (local files need none)."""
    first = source if isinstance(source, (str, os.PathLike)) else next(iter(source), "")
    if isinstance(first, str) and "://" in first:
        scheme = first.split("://", 1)[0]
        make = STORAGES.get(scheme)
        if make is None:
            raise ValueError(
                f"{redacted(first)}: no storage for {scheme}:// (known: {', '.join(STORAGES)}, or a local path)"
            )
        from streamload.storage.remote import ObjectPath

        return make(ObjectPath(first).root, None if cache_dir is None else Path(cache_dir))
    if hub_id(source) is not None:  # "org/name[@revision]" naming nothing local: the hub cache, else the hub
        return STORAGES["hf"](str(source), None if cache_dir is None else Path(cache_dir))
    return LocalStorage()


__all__ = ["INDEX_NAME", "STORAGES", "Digest", "Files", "Listing", "LocalFiles", "LocalStorage", "PathLike", "Source",
           "Storage", "is_hex", "storage_for"]  # fmt: skip
