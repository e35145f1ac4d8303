"""Where checkpoints live. One module per kind of storage; `STORAGES` maps a source's URL scheme to
the storage that serves it (a plain path is local). A new storage: a module with a class that meets
`base.Storage`, a row here, and a reader in `read/` that declares it serves the storage's `kind`."""

from __future__ import annotations

import os
from collections.abc import Callable

from .base import INDEX_NAME, Files, Listing, PathLike, Source, Storage
from .local import LocalFiles, LocalStorage


def _objects(root: str) -> Storage:
    from .remote import ObjectStorage  # obstore is imported only for URLs

    return ObjectStorage(root)


STORAGES: dict[str, Callable[[str], Storage]] = {"s3": _objects, "http": _objects, "https": _objects}


def storage_for(source: Source) -> Storage:
    """The storage that holds `source`: by its URL scheme (s3://, http(s)://), else the local one."""
    first = source if isinstance(source, (str, os.PathLike)) else next(iter(source), "")
    if isinstance(first, str) and "://" in first:
        scheme = first.split("://", 1)[0]
        make = STORAGES.get(scheme)
        if make is None:
            raise ValueError(f"{first}: no storage for {scheme}:// (known: {', '.join(STORAGES)}, or a local path)")
        from .remote import ObjectPath

        return make(ObjectPath(first).root)
    return LocalStorage()


__all__ = ["INDEX_NAME", "STORAGES", "Files", "Listing", "LocalFiles", "LocalStorage", "PathLike", "Source",
           "Storage", "storage_for"]  # fmt: skip
