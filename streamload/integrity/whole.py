"""A whole file's digest: its bytes hashed in file order as they arrive, and the one verdict on them at the
end, an IntegrityError naming the file where they are not what the digest says. The one place a file's
digest is computed and judged for a download (storage/hub.py: a hub file's SHA-256, or its git blob id)."""

from __future__ import annotations

import hashlib
from typing import Any

from streamload.base.errors import IntegrityError


class WholeFileMismatch(IntegrityError):
    """A file's bytes do not have its whole-file digest: any of them may be the damaged ones, so every tensor
    of the file handed out before the verdict is suspect (the pipeline names them in `handed_out`)."""


_HEX_DIGITS = {"sha256": 64, "sha1": 40, "md5": 32}
_SHOWN = {"sha256": "SHA-256", "sha1": "SHA-1", "md5": "MD5"}


class WholeFile:
    """The digest of one file's bytes, fed in file order (`update`), judged once they are all in (`verdict`).

    `algorithm`: "sha256", "sha1" or "md5"; `expected_hex`: the digest the file must have; `what`: the file
    as an error names it (with its repo, revision or URL); `origin`: who says so (an error says it too);
    `prefix`: bytes hashed before the file's own (git's `blob <size>\\0`, whose SHA-1 is a git blob's id).
    """

    def __init__(self, algorithm: str, expected_hex: str, what: str, *, origin: str = "", prefix: bytes = b"",
                 path: object = None) -> None:  # fmt: skip
        digits = _HEX_DIGITS.get(algorithm)
        if digits is None:
            raise ValueError(f"{what}: no whole-file digest {algorithm!r} (known: {', '.join(_HEX_DIGITS)})")
        expected = expected_hex.lower()
        if len(expected) != digits or any(c not in "0123456789abcdef" for c in expected):
            raise ValueError(f"{what}: {expected_hex!r} is not a {_SHOWN[algorithm]} ({digits} hex digits)")
        self.algorithm, self.expected, self.what, self.origin = algorithm, expected, what, origin
        self.path = path  # the error's `path`: the file as the load names it
        self._prefix = prefix
        self.reset()

    def reset(self) -> None:
        """Start again from the file's first byte (its download started again)."""
        # SHA-1 and MD5 name bytes here (git's blob ids, S3's ETags), they are not a defence of their own
        self._hash: Any = hashlib.new(self.algorithm, usedforsecurity=self.algorithm == "sha256")
        self._hash.update(self._prefix)
        self.hashed = 0  # bytes of the file fed so far

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """The file's next bytes, in file order."""
        self._hash.update(data)
        self.hashed += len(data)

    def verdict(self) -> None:
        """None where the bytes fed are the file the digest names; else WholeFileMismatch naming the file."""
        got = self._hash.hexdigest()
        if got != self.expected:
            said = f" as {self.origin} says" if self.origin else ""
            raise WholeFileMismatch(
                f"{self.what}: its {_SHOWN[self.algorithm]} is {got}, not {self.expected}{said} "
                f"({self.hashed} bytes hashed): the bytes are damaged or are another file's",
                self.path,
            )
