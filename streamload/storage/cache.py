"""A local copy of objects, written as their bytes stream past, so that the next load is local.

Layout: `cache_dir/<scheme>/<bucket or host>/<key>`, with `<key>.streamload.json` beside it holding the
object's size and ETag (or Last-Modified). A file being written is `<key>.partial`: it becomes `<key>`
(an atomic rename, after the data is on disk and its record written) only once every byte of the
object was written, so a partial file never looks complete; an incomplete one is removed when the
load ends (a load of some tensors only, a failed or cancelled load).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path, PurePath

from ..format import FileHeader

RECORD = ".streamload.json"


def cache_path(cache_dir: Path, path: PurePath) -> Path:
    """Where the copy of the object at `path` (an ObjectPath) lives."""
    scheme, host, *key = path.parts
    return cache_dir / scheme.rstrip(":") / host.replace(":", "_") / Path(*key)


def lookup(cache_dir: Path, headers: tuple[FileHeader, ...]) -> list[Path] | None:
    """The local copies of every file, if the cache holds all of them at the versions whose headers
    were just read (size and ETag); else None."""
    found = []
    for h in headers:
        local = cache_path(cache_dir, h.path)
        try:
            record = json.loads(Path(str(local) + RECORD).read_text())
            ok = record == _record(h) and local.stat().st_size == h.size
        except (OSError, ValueError):
            ok = False
        if not ok:
            return None
        found.append(local)
    return found


class CacheWriter:
    """Writes one object's bytes to its partial file as they arrive, and completes it when all have."""

    def __init__(self, cache_dir: Path, header: FileHeader, head: bytes) -> None:
        self.header = header
        self.final = cache_path(cache_dir, header.path)
        self.partial = Path(str(self.final) + ".partial")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        for stale in (self.final, Path(str(self.final) + RECORD)):  # another version: not the one to keep
            stale.unlink(missing_ok=True)
        self._fd: int | None = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        os.ftruncate(self._fd, header.size)
        self._lock = threading.Lock()
        self._written: list[tuple[int, int]] = []  # merged [start, end) ranges
        self.write(0, memoryview(head)[: header.data_start])

    def write(self, offset: int, data: memoryview) -> None:
        with self._lock:
            fd = self._fd
            if fd is None:
                return
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
            self._written = _merged([*self._written, (offset, offset + len(data))])
            if self._written == [(0, self.header.size)]:
                self._complete(fd)

    def _complete(self, fd: int) -> None:
        os.fsync(fd)
        os.close(fd)
        self._fd = None
        record = Path(str(self.final) + RECORD)
        tmp = Path(str(record) + ".partial")
        tmp.write_text(json.dumps(_record(self.header)))
        os.replace(tmp, record)
        os.replace(self.partial, self.final)  # last: the name appears only for a complete file

    def close(self) -> None:
        """Drop an incomplete copy (complete ones were renamed already)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self.partial.unlink(missing_ok=True)


def _record(header: FileHeader) -> dict[str, object]:
    """What identifies the version of an object that was copied: its size and ETag (or Last-Modified)."""
    return {"size": header.size, "version": ":".join(str(x) for x in header.identity[1:])}


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
