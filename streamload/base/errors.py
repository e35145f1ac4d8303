"""The errors streamload raises: one base class, each naming the file (and tensor)."""

from __future__ import annotations


class StreamloadError(Exception):
    """Base class of every error streamload raises on purpose."""


class SourceError(StreamloadError, ValueError):
    """The checkpoint's location or layout is wrong (no files, bad index, duplicate names)."""


class MissingFileError(SourceError, FileNotFoundError):
    """A file the checkpoint needs does not exist."""


class HeaderError(StreamloadError, ValueError):
    """A safetensors header breaks the format."""


class UnsupportedError(StreamloadError, ValueError):
    """Valid input this torch or this machine cannot represent (a dtype, a device)."""


class ReadError(StreamloadError, OSError):
    """Reading tensor bytes failed (I/O error, file truncated or changed after its header was read)."""


class IntegrityError(StreamloadError):
    """Bytes read do not match the checkpoint's known digest (a damaged or changed file), or a load
    asked to be verified has no digest to check against. `path`: the damaged file; `handed_out`: the
    tensors of it that `iter` had handed out before the mismatch was found (a file checked as a whole
    is judged at its end)."""

    def __init__(self, message: str, path: object = None) -> None:
        super().__init__(message)
        self.path = path
        self.handed_out: list[str] = []

    def __str__(self) -> str:
        if not self.handed_out:
            return super().__str__()
        return f"{super().__str__()}; handed out already: {listed(self.handed_out, 5)}"


def listed(names: list[str], most: int = 20) -> str:
    """Names as an error lists them: the first `most`, quoted, and how many more.

    >>> listed(["a", "b", "c"], 2)
    "'a', 'b' and 1 more"
    """
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
