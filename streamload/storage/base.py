"""What a storage is: where a checkpoint's files are, their headers' bytes, and byte ranges of them. A storage
says what it can do (`local`) and the reader table (pipeline/reader_choice.py) asks that, never which storage it
is; each header carries the version it was read from (`format.header.FileVersion`), typed."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path, PurePath
from typing import NamedTuple, Protocol

from streamload.base.errors import SourceError
from streamload.format.header import FileHeader, FileVersion
from streamload.integrity.digests import Digest, Known

PathLike = str | os.PathLike[str]
Source = PathLike | Sequence[PathLike]
INDEX_NAME = "model.safetensors.index.json"
# An index file's name: `<name>.index.json`, or with a variant (`<name>.safetensors.index.fp16.json`, as
# diffusers' `save_pretrained(variant=...)` names it).
_INDEX = re.compile(r".+\.index\.json|.+\.safetensors\.index\.[\w-]+\.json")


def is_index(name: str) -> bool:
    return _INDEX.fullmatch(name) is not None


Partly = Callable[[], Collection[PurePath]] | None  # the files a load reads in part


class Listing(NamedTuple):
    """A source's files, and its index when it has one."""

    files: list[PurePath]
    weight_map: dict[str, str] | None = None
    index: PurePath | None = None
    index_metadata: dict[str, object] | None = None


class Copied(NamedTuple):
    """A cache's complete copies of a checkpoint's files, and the origin-bound digests each copy's bytes are
    checked against before they are handed out (by copy; a copy absent there is this user's own)."""

    paths: list[Path]
    checks: dict[PurePath, Known]
    identities: list[FileVersion] | None = None  # each copy's as judged (`local.file_identity`): a copy put
    # in its place since (by a co-user who owns a folder above it) is not read


class Files(Protocol):
    """The open files of one load (what readers read from)."""

    def read(self, path: PurePath, offset: int, length: int) -> list[memoryview]:
        """`length` bytes at `offset`, from the version whose header was read, in order (for small
        ranges outside a reader's plan: the edges of digest blocks a rank's slice cuts)."""
        ...

    def cancel(self) -> None:
        """Make reads in flight give up soon (thread-safe; the load is being stopped)."""
        ...

    def close(self) -> None:
        """Release everything (after every read has returned)."""
        ...


class Storage(Protocol):
    local: bool  # files on a local file system, read by descriptor (else by ranges through `Files.read`)
    first_batch: int  # bytes of a plan's first batch, doubling up to a slot (0: every batch a slot; plan/plan.py)

    def locate(self, source: Source) -> Listing:
        """The files of `source`: a file, a directory or prefix (its index when present), a list."""
        ...

    def header(self, path: PurePath) -> FileHeader:
        """The validated header of one file, with the identity its later reads are checked against."""
        ...

    def open(self, headers: dict[PurePath, FileHeader], partly: Partly = None) -> Files:
        """Open the files a plan reads, checking each is still the one whose header was read; `partly`
        tells those it does not read every byte of (asked only where a cache keeps copies: a plan of
        many tensors takes milliseconds to tell)."""
        ...

    def cached(self, headers: tuple[FileHeader, ...]) -> Copied | None:
        """Local copies of all these files at these versions, if a cache holds them and each either passes
        the integrity layer (`Copied.checks`) or is this user's own; else None."""
        ...

    def digest(self, header: FileHeader) -> Digest | None:
        """A digest of the whole file that the storage knows without reading it (a Hugging Face cache
        blob's name, an object's ETag where it is an MD5), else None."""
        ...

    def sidecar(self, near: PurePath, name: str) -> bytes | None:
        """The bytes of the small file `name` in the folder (or prefix) of `near`; None if absent."""
        ...

    def held_until_checked(self) -> Storage:
        """This storage for a load that hands out nothing unchecked (`verify=`): one that checks what it
        serves (a hub download's SHA-256) holds each byte until its file passed; any other is itself."""
        ...


# A URL's user info: from the scheme's "//" to the last "@" before the path (a password may hold a raw "@").
_USER_INFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s]*@")


def redacted(text: object) -> str:
    """`text` (a URL, a path, a message or a list of them) with the user info of every URL in it (`user:password@`,
    or a token given as the user) shown as `***@`: wherever a source as the caller wrote it is formatted."""
    return _USER_INFO.sub(r"\1***@", str(text))


def first_line(exc: BaseException | None) -> str:
    """An error's first line (obstore's debug trail cut, user info redacted), else its type's name."""
    text = redacted(str(exc).split("\n\nDebug source:")[0].strip())
    return text.splitlines()[0][:300] if text else type(exc).__name__


def is_hex(text: str) -> bool:
    """Lower-case hexadecimal digits only (as digests are written)."""
    return bool(text) and all(c in "0123456789abcdef" for c in text)


def file_list(paths: list[PurePath]) -> Listing:
    """A source given as a list of files: at least one, none twice."""
    if not paths:
        raise SourceError("the list of checkpoint files is empty")
    if len(set(paths)) != len(paths):
        raise SourceError("the list of checkpoint files names a file twice")
    return Listing(paths)


def parse_index(index: PurePath, raw: str | bytes) -> Listing:
    """An index's shards (sorted, plain file names next to the index), weight map and metadata."""
    try:
        doc = json.loads(raw)  # bytes not UTF-8 (nor UTF-16/32) raise a ValueError too
    except ValueError as exc:
        raise SourceError(f"{index}: cannot read the index: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SourceError(f"{index}: 'weight_map' must map tensor names to file names")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if PurePath(shard).name != shard or shard in (".", ".."):
            raise SourceError(f"{index}: shard {shard!r} is not a plain file name")
    meta = doc.get("metadata")
    return Listing([index.parent / s for s in shards], weight_map, index, meta if isinstance(meta, dict) else None)
