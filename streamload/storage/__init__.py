"""Where checkpoints live. One module per kind of storage; `STORAGES` maps a source's URL scheme to
the storage that serves it, as `remote.PROFILES` does each object store's (a plain path is local). A new
object store: a row of `remote.PROFILES`. A new storage: a module with a class that meets `base.Storage`
(its capabilities, `local`, choose its readers: pipeline/reader_choice.py) and a row here."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from streamload.storage.base import INDEX_NAME, Digest, Files, Listing, PathLike, Source, Storage, is_hex, redacted
from streamload.storage.hub import HubStorage, hub_id
from streamload.storage.local import LocalFiles, LocalStorage

# and each object store's: remote.PROFILES (huggingface_hub is imported only once a hub id is loaded)
STORAGES: dict[str, Callable[[str, Path | None], Storage]] = {"hf": lambda root, cache: HubStorage(cache)}


def storage_for(source: Source, cache_dir: PathLike | None = None) -> Storage:
    """The storage that holds `source`: by its URL scheme (hf://, or an object store's: remote.PROFILES), a
    Hugging Face hub id (`org/name[@revision]` where no local path has that name: storage/hub.py), else the
    local one. `cache_dir`: where a remote storage keeps local copies of what it reads (local files need none)."""
    first = source if isinstance(source, (str, os.PathLike)) else next(iter(source), "")
    cache = None if cache_dir is None else Path(cache_dir)
    if isinstance(first, str) and "://" in first:
        scheme = first.split("://", 1)[0]
        from streamload.storage.remote import PROFILES, ObjectPath, ObjectStorage  # obstore only for URLs

        if scheme not in STORAGES and scheme not in PROFILES:
            known = ", ".join([*STORAGES, *PROFILES])
            raise ValueError(f"{redacted(first)}: no storage for {scheme}:// (known: {known}, or a local path)")
        make = STORAGES.get(scheme, ObjectStorage)
        return make(ObjectPath(first).root, cache)
    if hub_id(source) is not None:  # "org/name[@revision]" naming nothing local: the hub cache, else the hub
        return STORAGES["hf"](str(source), cache)
    return LocalStorage()


__all__ = ["INDEX_NAME", "STORAGES", "Digest", "Files", "Listing", "LocalFiles", "LocalStorage", "PathLike", "Source",
           "Storage", "is_hex", "storage_for"]  # fmt: skip
