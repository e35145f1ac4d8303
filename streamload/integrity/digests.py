"""The digest file `streamload digest` writes beside a checkpoint (`streamload.digests.json`): its formats, its
block size and hashes, and which version of the origin's file an entry was made from.

Format 2 (written now): a BLAKE3 of each `BLOCK_BYTES` of each tensor, the whole file's SHA-256 and MD5, the
SHA-256 of its header bytes, and the origin's version the entry was made from (an object's ETag, a local file's
modification time). BLAKE3 is a cryptographic hash: no one can make other bytes with the same digests, so a
format-2 entry bound to the origin's version is proof against a malicious peer or cache. Measured on one core
of this project's machines: BLAKE3 ~4-6 GB/s on MiB blocks, SHA-256 ~1.1-1.7 GB/s, xxh3 ~9-50 GB/s.

Format 1 (xxh3-64 blocks, older files): still read by `verify=` as a check against corruption, but no proof
against anyone who chooses the bytes (xxh3 collisions are computed in a minute), so peers and caches never
rely on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from streamload.base.errors import IntegrityError
from streamload.format.header import FileHeader

DIGEST_FILE = "streamload.digests.json"
FORMAT = "streamload-digests/2"
FORMATS = ("streamload-digests/1", FORMAT)
BLOCK_BYTES = 1 << 20  # a rank's slice is verified block by block, the blocks it cuts completed from the file
BLOCK_HASH = "blake3"
CRYPTOGRAPHIC = frozenset({"blake3"})  # block hashes no one can collide on purpose


class Digest(NamedTuple):
    """A whole file's digest: the hashlib algorithm, the hex digest, and where it was learnt."""

    algorithm: str  # "sha256" or "md5"
    hex: str
    origin: str


class Known(NamedTuple):
    """What is known of one file's digests, and from where."""

    whole: Digest | None = None
    blocks: Mapping[str, Sequence[str]] | None = None  # tensor name -> digest of each block
    block_bytes: int = BLOCK_BYTES
    origin: str = ""  # of the blocks
    stale: str | None = None  # why the digest file's entry does not describe this file
    header_sha256: str | None = None  # of the bytes before the data (length word, header): with blocks,
    # a header changed to another dtype or shape of the same size is caught too
    block_hash: str = BLOCK_HASH  # the digest file's (format 1: xxh3-64, format 2: blake3)


def _blake3() -> Any:
    import blake3  # imported by loads that check blocks only

    return blake3.blake3()


def _xxh3() -> Any:
    import xxhash

    return xxhash.xxh3_64()


HASHERS: dict[str, Callable[[], Any]] = {"blake3": _blake3, "xxh3-64": _xxh3}  # a block hash: one row


def block_hasher(name: str = BLOCK_HASH) -> Any:
    """A fresh hasher of the block hash `name` (`update`, `hexdigest`)."""
    return HASHERS[name]()


def block_digest(data: memoryview | bytes, name: str = BLOCK_HASH) -> str:
    hasher = HASHERS[name]()
    hasher.update(data)
    return str(hasher.hexdigest())


def parse(raw: bytes, where: str) -> dict[str, Any]:
    """The digest file's document, checked (`block_bytes` and `block_hash` filled in); raises IntegrityError
    naming `where`."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{where}: not a digest file (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS or not isinstance(doc.get("files"), dict):
        raise IntegrityError(f"{where}: not a digest file of format {FORMAT!r}; write it anew with `streamload digest`")
    block = doc.setdefault("block_bytes", BLOCK_BYTES)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise IntegrityError(f"{where}: block_bytes must be a positive integer, not {block!r}")
    hashed = doc.setdefault("block_hash", "xxh3-64" if doc["format"] == FORMATS[0] else BLOCK_HASH)
    if hashed not in HASHERS or (doc["format"] == FORMAT) != (hashed in CRYPTOGRAPHIC):
        raise IntegrityError(f"{where}: block_hash {hashed!r} is not one of format {doc['format']!r}")
    return doc


def entry_of(
    doc: Mapping[str, Any] | None, name: str, size: int, origin: str
) -> tuple[dict[str, Any] | None, str | None]:
    """The digest file's entry for the file `name` of `size` bytes; else (None, why it does not describe the
    file), the why None where the digest file has no entry for it."""
    entry = (doc or {}).get("files", {}).get(name)
    if not isinstance(entry, dict):
        return None, None
    if entry.get("size") != size:
        return None, f"{origin} was made for a file of {entry.get('size')} bytes, this one has {size}"
    return entry, None


# -- which version of the origin an entry describes ------------------------------------------------------
class Version(NamedTuple):
    """The origin's version of one file as its header read it: what a format-2 entry names to be bound to it."""

    etag: str | None = None  # a strong ETag (objects)
    mtime_ns: int | None = None  # a local file's modification time
    sha256: str | None = None  # a whole-file SHA-256 the storage knows without reading (a hub blob's name)
    md5: str | None = None  # the object's MD5, only where its store vouches that its ETag is one (S3's)


def version_of(header: FileHeader, known: Digest | None = None) -> Version:
    """The origin version a header was read at (its storage's `FileVersion`: a strong ETag, else a local mtime),
    with the whole-file digest its storage knows without reading (`Storage.digest`): most stores' ETags are
    opaque, so an ETag is taken for the object's MD5 only where its storage says it is one."""
    v = header.identity
    vouched = {known.algorithm: known.hex} if known is not None else {}
    sha256, md5 = vouched.get("sha256"), vouched.get("md5")
    if v is not None and v.content is not None:  # a hub file: its LFS ETag is the file's SHA-256
        return Version(sha256=v.content.strip('"').lower())
    if v is not None and v.etag is not None:
        return Version(etag=v.etag, sha256=sha256, md5=md5)
    if v is not None and v.mtime_ns is not None and v.size == header.size:
        return Version(mtime_ns=v.mtime_ns, sha256=sha256)
    return Version(sha256=sha256)


def made_from(header: FileHeader) -> dict[str, object]:
    """What a new entry says of the version it was made from (`bound` checks it later)."""
    version = version_of(header)  # a strong ETag, else a local file's mtime, never both
    return {k: v for k, v in (("etag", version.etag), ("mtime_ns", version.mtime_ns)) if v is not None}


def bound(entry: Mapping[str, Any], version: Version) -> str | None:
    """None where the format-2 `entry` was made from the origin's `version`; else why it is not known to be
    (a digest file left from an earlier version that has the same size and header is not proof of anything)."""
    made = entry.get("origin")
    made = made if isinstance(made, dict) else {}
    if version.etag is not None:
        if made.get("etag") == version.etag or (version.md5 is not None and entry.get("md5") == version.md5):
            return None
        return f"its entry was made from another version of the object than its ETag {version.etag} names"
    if version.sha256 is not None and entry.get("sha256") == version.sha256:
        return None
    if version.mtime_ns is not None and made.get("mtime_ns") == version.mtime_ns:
        return None
    return "its entry names no version of the file that the origin's matches"


__all__ = ["BLOCK_BYTES", "BLOCK_HASH", "DIGEST_FILE", "FORMAT", "FORMATS", "HASHERS", "Digest", "Known", "Version",
           "block_digest", "block_hasher", "bound", "entry_of", "made_from", "parse", "version_of"]  # fmt: skip
