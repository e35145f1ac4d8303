"""Where a checkpoint's files are: a file, a directory (with or without an index), or a list of files."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from .errors import MissingFileError, SourceError
from .format import FileHeader, TensorInfo, read_header

PathLike = str | os.PathLike[str]
Source = PathLike | Sequence[PathLike]
INDEX_NAME = "model.safetensors.index.json"


class Checkpoint(NamedTuple):
    """The files of a checkpoint with their validated headers, and every tensor by name."""

    files: tuple[FileHeader, ...]
    tensors: dict[str, TensorInfo]
    index_metadata: dict[str, object] | None = None

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


def open_checkpoint(source: Source) -> Checkpoint:
    """Find the files of `source` and read every header (no tensor data is read)."""
    paths, weight_map, index_path, index_meta = _files(source)
    headers = tuple(read_header(p) for p in paths)
    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in tensors:
                raise SourceError(f"tensor {t.name!r} appears in both {tensors[t.name].path} and {h.path}")
            tensors[t.name] = t
    if weight_map is not None:
        for name, shard in weight_map.items():
            where = tensors.get(name)
            if where is None or where.path.name != shard:
                raise SourceError(f"{index_path}: tensor {name!r} is mapped to {shard}, which does not hold it")
    return Checkpoint(headers, tensors, index_meta)


def _files(source: Source) -> tuple[list[Path], dict[str, str] | None, Path | None, dict[str, object] | None]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            index = path / INDEX_NAME
            if index.is_file():
                return _from_index(index)
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise SourceError(f"{path}: directory holds no *.safetensors file")
            return found, None, None, None
        if path.name.endswith(".index.json") and path.is_file():
            return _from_index(path)
        if not path.exists():
            raise MissingFileError(f"{path}: no such file or directory")
        return [path], None, None, None
    paths = [Path(p) for p in source]
    if not paths:
        raise SourceError("the list of checkpoint files is empty")
    if len(set(paths)) != len(paths):
        raise SourceError("the list of checkpoint files names a file twice")
    return paths, None, None, None


def _from_index(index: Path) -> tuple[list[Path], dict[str, str], Path, dict[str, object] | None]:
    try:
        doc = json.loads(index.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{index}: cannot read the index: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SourceError(f"{index}: 'weight_map' must map tensor names to file names")
    shards = sorted(set(weight_map.values()))
    root = index.parent.resolve()
    for shard in shards:
        if Path(shard).name != shard or shard in (".", ".."):
            raise SourceError(f"{index}: shard {shard!r} is not a plain file name")
        if not (index.parent / shard).is_file():
            raise MissingFileError(f"{index}: shard {shard} is missing")
        if (index.parent / shard).resolve().parent != root:  # a symlink pointing out of the checkpoint
            raise SourceError(f"{index}: shard {shard} links outside the checkpoint's directory")
    meta = doc.get("metadata")
    return [index.parent / s for s in shards], weight_map, index, meta if isinstance(meta, dict) else None
