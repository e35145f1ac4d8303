"""The public entry points' arguments, checked once, up front: a one-line error naming the argument
instead of a traceback from deep inside a load; sizes with units, as the command line takes them."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
         "g": 1 << 30, "gib": 1 << 30, "gb": 10**9}  # fmt: skip
T = TypeVar("T")  # a checked value, handed back as given
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """A byte count from text: `4194304`, `4MiB`, `4M` (binary), `4MB` (decimal), `1.5GiB`."""
    match = _SIZE.fullmatch(text)
    unit = match and UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"{text!r} is not a size: use bytes or a unit, e.g. 4MiB, 512KiB, 1GiB")
    value = int(float(match.group(1)) * unit)
    if value < 1:
        raise ValueError(f"must be at least 1 byte, not {text!r}")
    return value


def described(value: object) -> str:
    """A value as a message shows it: its type, and what it is where that is short."""
    return f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str, bytes)) else type(value).__name__


def size(value: int | str | None, name: str) -> int | None:
    """A size in bytes: a whole number, or text with a unit ("1GiB"); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a size in bytes (an int, or text such as '1GiB'), not {described(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 byte, not {value}")
    return value


def count(value: int | None, name: str) -> int | None:
    """A count of at least 1 (threads, slots); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, not {described(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return value


def patterns(value: T, name: str) -> T:
    """None, a pattern, a predicate, or an iterable of patterns."""
    if value is None or isinstance(value, str) or callable(value):
        return value
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        bad = [p for p in value if not isinstance(p, str)]
        if not bad:
            return value
        raise TypeError(f"{name} patterns must be text, not {described(bad[0])}")
    raise TypeError(f"{name} must be a pattern, a list of patterns or a predicate, not {described(value)}")


def source(value: object) -> None:
    """A path, URL or list of them (a `Checkpoint` is taken before its arguments are checked)."""
    if isinstance(value, (str, os.PathLike)):
        return
    if isinstance(value, (list, tuple)) and value:
        bad = next((i for i, v in enumerate(value) if not isinstance(v, (str, os.PathLike))), None)
        if bad is None:
            return
        raise TypeError(f"source[{bad}] must be a path or a URL, not {described(value[bad])}")
    raise TypeError(
        "source must be a path, a URL, a non-empty list of them, or a Checkpoint from inspect(), "
        f"not {described(value)}"
    )


def path(value: object, name: str) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path, not {described(value)}")


def into(value: T, name: str = "into") -> T:
    import torch  # here, not above: the command line parses sizes before torch is imported

    if value is None:
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of tensor names to tensors, not {described(value)}")
    for key, t in value.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, not {described(t)}")
    return value


def verify(value: T, name: str = "verify") -> T:
    """True/False, or {file name: SHA-256 hex}."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, Mapping):
        for key, digest in value.items():
            if not isinstance(key, str) or not isinstance(digest, str):
                raise TypeError(f"{name}[{key!r}] must be a SHA-256 hex digest (text), not {described(digest)}")
        return value
    raise TypeError(f"{name} must be True, False or {{file name: SHA-256 hex}}, not {described(value)}")


def peers(value: T, name: str = "peers") -> T:
    """None, a peer's URL (or several, with commas: `storage/peers.py`), or a list of them; an entry that
    names no peer is left out at the load, with a warning (peers can only make a load faster)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)  # an index: None is an entry
        if bad is None:
            return value
        raise TypeError(f"{name} must be URLs or host names (text), not {described(value[bad])} ({name}[{bad}])")
    raise TypeError(f"{name} must be a URL, a host name or a list of them, not {described(value)}")


__all__ = ["count", "described", "into", "parse_size", "path", "patterns", "peers", "size", "source", "verify"]
