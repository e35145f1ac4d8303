"""The check every block from a peer or a cache copy passes before a byte of it is handed out.

A file's checked units are the blocks of each tensor that its origin's format-2 digest entry names, taken only
where that entry is bound to the origin's version (`digests.bound`) and made for the header this load read from
the origin. A unit that fails is read from the origin and checked too (`Units.settle`): where the origin's
bytes match, the other source lied or its copy is damaged (`FORGED`); where they fail as well, the digest file
is stale (`STALE`: the origin's bytes are handed out, the source not blamed, the digests no longer used).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, NamedTuple

from streamload.format.header import FileHeader
from streamload.integrity.digests import CRYPTOGRAPHIC, Known, Version, block_digest, bound, entry_of

PIECE = 8 << 20  # the most one segment of checked units covers (whole blocks)


class Unit(NamedTuple):
    """A range of a file that is fetched and checked whole: a digest block of one tensor."""

    start: int
    end: int
    digest: str | None  # None: not checked (a peers opt-in that never becomes a kept copy)
    what: str  # how a message names it


class Outcome(Enum):
    MATCHED = "matched"
    FORGED = "forged"  # the source's bytes failed, the origin's matched: replaced by the origin's
    STALE = "stale"  # the origin's failed too: the digests do not describe the origin (origin's bytes kept)
    UNCHECKED = "unchecked"  # units without digests


class Units:
    """The checked units of one file, in file order (a tensor's blocks, then the next tensor's)."""

    def __init__(self, units: list[Unit], hash_name: str = "blake3", where: str = "") -> None:
        self.units = units
        self.ends = [u.end for u in units]
        self.hash_name = hash_name
        self.where = where  # the digest file they come from

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """[lo, hi) cut into (start, end, i, j): units i..j-1 (contiguous, at most `PIECE` bytes together)
        where i < j, or bytes no unit covers (i == j: read from the origin)."""
        out: list[tuple[int, int, int, int]] = []
        units, i, pos = self.units, bisect_right(self.ends, lo), lo
        while pos < hi:
            if i < len(units) and units[i].start <= pos:
                j = i + 1
                while (j < len(units) and units[j].start == units[j - 1].end and units[j - 1].end < hi
                       and units[j].end - units[i].start <= PIECE):  # fmt: skip
                    j += 1
                out.append((units[i].start, units[j - 1].end, i, j))
                pos, i = units[j - 1].end, j
            else:
                nxt = min(hi, units[i].start if i < len(units) else hi)
                out.append((pos, nxt, i, i))
                pos = nxt
        return out

    def settle(self, units: list[Unit], data: memoryview, start: int, origin: Callable[[int, int], bytes]
               ) -> tuple[Outcome, Unit | None]:  # fmt: skip
        """Check `data` (the bytes of `units`, from `start`) unit by unit; a unit that fails is replaced in
        `data` by the origin's bytes (`origin(offset, length)`), themselves checked. The worst outcome and
        the first unit that failed."""
        worst, first = Outcome.MATCHED, None
        for unit in units:
            piece = data[unit.start - start : unit.end - start]
            if unit.digest is None:
                worst = Outcome.UNCHECKED if worst is Outcome.MATCHED else worst
                continue
            if block_digest(piece, self.hash_name) == unit.digest:
                continue
            piece[:] = origin(unit.start, unit.end - unit.start)
            theirs = Outcome.FORGED if block_digest(piece, self.hash_name) == unit.digest else Outcome.STALE
            if first is None or theirs is Outcome.STALE:
                worst, first = theirs, unit
        return worst, first


def origin_known(header: FileHeader, doc: Mapping[str, Any] | None, where: str, version: Version
                 ) -> tuple[Known | None, str]:  # fmt: skip
    """The block digests of one file that its origin's digest file (`doc`) gives, or (None, why there are none):
    the entry must be of a cryptographic block hash, bound to the origin's `version`, made for this header, and
    hold every tensor's blocks."""
    entry, stale = entry_of(doc, header.path.name, header.size, where)
    if stale is not None:
        return None, stale
    if entry is None or doc is None:
        return None, f"no digests of it ({where} {'has no entry for it' if doc else 'is absent'})"
    hash_name = str(doc.get("block_hash"))
    if hash_name not in CRYPTOGRAPHIC:
        return None, (f"{where} is of format 1 ({hash_name} blocks, a check against damage only, not against a "
                      "party that chooses the bytes): write it anew with `streamload digest`")  # fmt: skip
    why = bound(entry, version)
    if why is not None:
        return None, f"{where}: {why} (write it anew with `streamload digest` for this version)"
    head = entry.get("header_sha256")
    if len(header.prefix) != header.data_start or hashlib.sha256(header.prefix).hexdigest() != head:
        return None, f"{where} was made for another version of it (its header differs)"
    block, blocks = int(doc.get("block_bytes", 1 << 20)), entry.get("tensors")
    for info in header.tensors:
        mine = blocks.get(info.name) if isinstance(blocks, dict) else None
        if not isinstance(mine, list) or len(mine) != -(-info.nbytes // block):
            return None, f"{where} has no digests of tensor {info.name!r} (or the wrong number)"
    return Known(None, blocks, block, where, header_sha256=head, block_hash=hash_name), ""


def origin_units(header: FileHeader, doc: Mapping[str, Any] | None, where: str, version: Version
                 ) -> tuple[Units | None, str]:  # fmt: skip
    """The checked units of one file (`origin_known`'s blocks, in file order), or (None, why there are none)."""
    known, why = origin_known(header, doc, where, version)
    if known is None or known.blocks is None:
        return None, why
    block, units = known.block_bytes, []
    for info in sorted(header.tensors, key=lambda t: t.begin):
        mine = known.blocks[info.name]
        for k in range(len(mine)):
            lo = info.begin + k * block
            units.append(Unit(lo, min(lo + block, info.end), str(mine[k]), f"tensor {info.name!r} block {k + 1}"))
    return Units(units, known.block_hash, where), ""


__all__ = ["PIECE", "Outcome", "Unit", "Units", "origin_known", "origin_units"]
