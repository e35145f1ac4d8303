"""The digest file `streamload digest` writes beside a checkpoint (`streamload.digests.json`): its name, its
format, its block size and hash. Below both of its readers: `verify.py` (a load's bytes checked as they are
read) and `peers.py` (each block a peer sends, checked before it is used)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import IntegrityError

DIGEST_FILE = "streamload.digests.json"
FORMAT = "streamload-digests/1"
BLOCK_BYTES = 1 << 20  # a rank's slice is verified block by block, the blocks it cuts completed from the file


def block_digest(data: memoryview | bytes) -> str:
    import xxhash  # imported by loads that verify only

    return xxhash.xxh3_64_hexdigest(data)


def block_hasher() -> Any:
    import xxhash

    return xxhash.xxh3_64()


def parse(raw: bytes, where: str) -> dict[str, Any]:
    """The digest file's document, checked (`block_bytes` filled in); raises IntegrityError naming `where`."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{where}: not a digest file (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise IntegrityError(f"{where}: not a digest file of format {FORMAT!r}; write it anew with `streamload digest`")
    block = doc.setdefault("block_bytes", BLOCK_BYTES)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise IntegrityError(f"{where}: block_bytes must be a positive integer, not {block!r}")
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
