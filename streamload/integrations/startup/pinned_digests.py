"""What from a checkpoint's store may run here: only bytes whose digest the user pinned.

The store is trusted with data, never with code (safetensors and vLLM's model inspections are data).
Compiled artifacts are code (vLLM and Inductor import generated Python and unpickle graphs from them),
so an archive published beside the weights is installed only where the user named its SHA-256
(`{"compile_cache": "sha256:<hex>"}`, or a list of them; `streamload compile-cache publish` prints it),
and checked before a byte of it is unpacked: whoever can write to the bucket cannot run code on the
nodes that load from it. No torch here: the fetch started before vLLM's import checks archives too.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

_PIN = re.compile(r"sha256:[0-9a-f]{64}")
HOW = (
    'pin the archives\' digests that `streamload compile-cache publish` printed: {"compile_cache": '
    '"sha256:<hex>"} (or a list of them); installing compiled artifacts runs code from the weights\' store'
)


def pins(option: Any, name: str = "compile_cache") -> frozenset[str]:
    """The digests the `compile_cache` option pins ("sha256:<hex>", or a list of them); empty where it
    is off (absent, None or False). `True` alone is refused: an opt-in names what it trusts."""
    if option is None or option is False:
        return frozenset()
    given = [option] if isinstance(option, str) else option
    if isinstance(given, (list, tuple)) and given and all(isinstance(p, str) for p in given):
        bad = [p for p in given if not _PIN.fullmatch(p.strip().lower())]
        if not bad:
            return frozenset(p.strip().lower() for p in given)
        raise ValueError(f"{name}: {bad[0]!r} is not a pinned digest (sha256: and 64 hex digits); {HOW}")
    raise ValueError(f"{name}: {option!r} pins nothing; {HOW}")


def digest(data: bytes) -> str:
    """`data`'s pin: "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Refused(Exception):
    """Bytes from the store whose digest the user did not pin: never unpacked nor run."""


def check(data: bytes, pinned: frozenset[str], what: str) -> None:
    """Refuse `data` (named `what`) unless its digest is one of `pinned`, naming both."""
    got = digest(data)
    if got not in pinned:
        raise Refused(
            f"{what} refused: its digest is {got}, the pinned one{'s are' if len(pinned) > 1 else ' is'} "
            f"{', '.join(sorted(pinned))}; nothing of it was installed"
        )
