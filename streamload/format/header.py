"""safetensors header parsing with the format's full validation. No I/O: a storage reads the bytes.

The layout: 8 bytes little-endian N, N bytes of UTF-8 JSON, then the data section, which the tensors'
``data_offsets`` must cover exactly, in order, without holes or overlaps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import PurePath
from typing import Any, NamedTuple

from streamload.base.errors import HeaderError
from streamload.format.dtypes import DTYPES, DType

HEADER_LIMIT = 100_000_000  # the reference implementation's cap on N
TENSOR_LIMIT = 1_000_000  # per file; the largest public checkpoints hold under 100,000 in all their files
FIRST_READ = 1 << 18  # one read usually covers the length word and the whole header


class TensorInfo(NamedTuple):
    """Where one tensor lives: file, dtype, shape and its absolute byte range in the file."""

    name: str
    path: PurePath  # a local Path, or an object's URL (storage.remote.ObjectPath)
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileVersion:
    """Which version of a file its header was read from, as its storage tells it; the storage checks every
    later read against it. Only the fields the storage knows are set."""

    size: int
    device: int | None = None  # a local file: its file system, inode and modification time
    inode: int | None = None
    mtime_ns: int | None = None
    etag: str | None = None  # an object's strong ETag: any change to the object changes it
    weak: str | None = None  # or only a weak one ("W/..."), which a change may keep
    modified: datetime | None = None  # an object's Last-Modified (one-second resolution)
    generation: str | None = None  # which of an object's versions (GCS's generation, S3's version id)
    content: str | None = None  # the hash a store names the bytes by (a hub file's etag: SHA-256 or git SHA-1)

    def __str__(self) -> str:
        """As a message shows it: "1234 bytes, ETag "abc", generation 17"."""
        said = [f"{LABELS[f.name]} {v}" for f in fields(self)[1:] if (v := getattr(self, f.name)) is not None]
        return ", ".join([f"{self.size} bytes", *said])

    def recorded(self) -> str:
        """How a cache record names this version of an object. Fixed across releases (messages may change,
        this may not): a copy an earlier release made stays valid, and peers of either release agree on it
        (their version tags are made from it)."""
        if self.etag is not None:
            named = f"etag:{self.etag}"
        elif self.weak is not None:
            named = f"weak:{self.weak}:{self.modified}"
        elif self.content is not None:
            named = f"hub:{self.content}"
        else:
            named = "size" if self.modified is None else f"modified:{self.modified}"
        return named if self.generation is None else f"{named}:generation:{self.generation}"


LABELS = {"device": "device", "inode": "inode", "mtime_ns": "mtime_ns", "etag": "ETag", "weak": "weak ETag",
           "modified": "Last-Modified", "generation": "generation", "content": "content hash"}  # fmt: skip


class FileHeader(NamedTuple):
    """A parsed, validated safetensors file header."""

    path: PurePath
    size: int
    data_start: int
    tensors: tuple[TensorInfo, ...]  # in file order
    metadata: dict[str, str] | None
    identity: FileVersion | None = None  # the version read: the storage checks that the data it reads
    # later comes from the very same file
    prefix: bytes = b""  # the file's bytes before the data section (length word and header), as read:
    # a whole-file digest is checked from these and the tensor bytes, without reading the header twice


ReadAt = Callable[[int, int], bytes]  # (offset, count) -> exactly `count` bytes of the file, or an error


def header_from(path: PurePath, size: int, head: bytes, read_at: ReadAt) -> FileHeader:
    """Validate the header of a file of `size` bytes whose first bytes are `head` (at least
    `min(size, FIRST_READ)` of them; `read_at` fetches the rest of a longer header)."""
    if size < 8:
        raise HeaderError(f"{path}: file is {size} bytes, too short for a safetensors header")
    n = int.from_bytes(head[:8], "little")
    start = head[8:].lstrip(b" \t\r\n")[:1]  # the header may be padded with whitespace
    if start and start != b"{":
        raise HeaderError(
            f"{path}: not a safetensors file: after its 8-byte length word the header is not a JSON object "
            f"('{{...}}'); the file starts {head[:16]!r}"
        )
    if n > HEADER_LIMIT:
        raise HeaderError(
            f"{path}: not a safetensors file, or a damaged one: its first 8 bytes give a header length of "
            f"{n} bytes, over the format's limit of {HEADER_LIMIT}"
        )
    if 8 + n > size:
        raise HeaderError(f"{path}: header length {n} runs past the end of the file ({size} bytes): truncated?")
    if 8 + n > len(head):
        head += read_at(len(head), 8 + n - len(head))
    return parse_header(path, size, head[8 : 8 + n])._replace(prefix=bytes(head[: 8 + n]))


def _no_duplicates(path: PurePath):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise HeaderError(f"{path}: header names {key!r} twice")
            out[key] = value
        return out

    return hook


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(path: PurePath, file_size: int, raw: bytes) -> FileHeader:
    """Validate header bytes (without the length word) of a file of `file_size` bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{path}: header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates(path))
    except HeaderError:
        raise
    except (ValueError, RecursionError) as exc:
        raise HeaderError(f"{path}: header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise HeaderError(f"{path}: header is not a JSON object but {type(obj).__name__}")

    data_start = 8 + len(raw)
    metadata = _metadata(path, obj.pop("__metadata__", None))
    if len(obj) > TENSOR_LIMIT:
        raise HeaderError(f"{path}: header lists {len(obj)} tensors, more than the limit of {TENSOR_LIMIT}")
    tensors = [_tensor(path, name, entry, data_start) for name, entry in obj.items()]
    by_offset = sorted(tensors, key=lambda t: (t.begin, t.end))
    cursor = data_start
    for t in by_offset:
        if t.begin != cursor:
            what = "overlaps the previous tensor" if t.begin < cursor else "leaves a hole before it"
            where = "starts at data offset 0" if cursor == data_start else f"starts at {cursor - data_start}"
            raise HeaderError(
                f"{path}: tensor {t.name!r}: data_offsets begin at {t.begin - data_start}, which {what} "
                f"(the next tensor must start where the previous ended; {where})"
            )
        cursor = t.end
    data_size = file_size - data_start
    if cursor - data_start > data_size:
        first = next(t for t in by_offset if t.end > file_size)
        raise HeaderError(
            f"{path}: file is truncated: tensor {first.name!r} (and every tensor after it) needs bytes up to "
            f"{first.end - data_start}, but the data section holds only {data_size} "
            f"({cursor - data_start - data_size} bytes missing in all)"
        )
    if cursor - data_start < data_size:
        raise HeaderError(f"{path}: {data_size - (cursor - data_start)} bytes are left over after the last tensor")
    return FileHeader(path, file_size, data_start, tuple(by_offset), metadata)


def _metadata(path: PurePath, meta: object) -> dict[str, str] | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings")
    return dict(meta)


def _tensor(path: PurePath, name: str, entry: object, data_start: int) -> TensorInfo:
    def bad(msg: str) -> HeaderError:
        return HeaderError(f"{path}: tensor {name!r}: {msg}")

    if not isinstance(entry, dict):
        raise bad(f"entry must be an object, not {type(entry).__name__}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise bad(f"missing {key!r}")
    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise bad(f"unknown dtype {dtype_name!r}")
    dtype = DTYPES[dtype_name]
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape must be a list of non-negative integers, not {shape!r}")
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise bad(f"data_offsets must be two non-negative integers, not {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets begin {begin} is after end {end}")
    numel = math.prod(shape)
    expected = dtype.nbytes(numel)
    if expected is None:
        raise bad(f"{numel} elements of {dtype_name} do not fill whole bytes")
    if expected != end - begin:
        raise bad(f"shape {shape} of {dtype_name} takes {expected} bytes but data_offsets span {end - begin}")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)
