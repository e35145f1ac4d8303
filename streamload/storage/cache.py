"""A local copy of objects, written as their bytes stream past, so that the next load is local.

Layout: `cache_dir/<scheme>/<bucket or host>/<key>`, with `<key>.streamload.json` beside it (the object's
size and ETag or Last-Modified, and the copy's inode and mtime) and `<key>.lock`, which the writer of `<key>` holds.

Any number of processes, on one host or on several over a shared file system, may fill and read one
cache at once:
- one writer per file: the process that takes the file's lock (`flock`, which the kernel drops when
  the process dies; over NFS it is a byte-range lock the server keeps) writes it; the others read the
  complete copy it leaves, waiting for it while it writes (`Copies.local`), instead of downloading again;
- a writer writes into a file of its own (`<key>.partial.<host>.<pid>.<random>`), never truncating or
  overwriting another's bytes, and renames it to `<key>` only once every byte is on disk, after its
  record: a copy counts as complete only if the record names the object's version and the copy's inode and mtime,
  so a killed writer leaves nothing that looks complete (its partial file is removed by the next writer);
- a complete copy is never written again: a newer version replaces it by a rename, and a reader that
  opened the old one keeps reading the old one's bytes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePath

from ..format import FileHeader

RECORD = ".streamload.json"
LOCK = ".lock"
_PARTIAL = ".partial."
_NOTICE_AFTER = 5.0  # seconds of waiting for another writer before it is logged

log = logging.getLogger("streamload")
_held: set[Path] = set()  # the files this process holds the lock of (an NFS lock is per process, not per fd)
_held_lock = threading.Lock()


def cache_path(cache_dir: Path, path: PurePath) -> Path:
    """Where the copy of the object at `path` (an ObjectPath) lives."""
    scheme, host, *key = path.parts
    return cache_dir / scheme.rstrip(":") / host.replace(":", "_") / Path(*key)


def complete(local: Path, header: FileHeader) -> bool:
    """Whether `local` is a whole copy of the version of the object whose header was read."""
    try:
        return _vouched(local, local.stat(), header)
    except OSError:
        return False


def _vouched(local: Path, st: os.stat_result, header: FileHeader) -> bool:
    """Whether `local`'s record vouches for the file `st` describes as a whole copy of `header`'s version."""
    try:
        record = json.loads(Path(str(local) + RECORD).read_text())
    except (OSError, ValueError):
        return False
    return record == {**_record(header), **_file(st)} and st.st_size == header.size


def lookup(cache_dir: Path, headers: Sequence[FileHeader]) -> list[Path] | None:
    """The local copies of every file, if the cache holds all of them complete at the versions whose
    headers were just read; else None (never waits: files being written are the load's to wait for)."""
    found = [cache_path(cache_dir, h.path) for h in headers]
    return found if all(complete(local, h) for local, h in zip(found, headers, strict=True)) else None


def keep(local: Path, data: bytes) -> None:
    """A small file (an index, a digest file) into the cache whole: written under a name of this
    writer's own, then renamed, so that two writers never mix their bytes and a reader sees one whole."""
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f"{local.name}{_PARTIAL}{_writer_tag()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def _writer_tag() -> str:
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


class Claim:
    """The right to write one file of the cache: its lock, held by this process and no other."""

    def __init__(self, final: Path, fd: int) -> None:
        self.final = final
        self._fd: int | None = fd

    @classmethod
    def take(cls, final: Path) -> Claim | None:
        """The claim, if no other writer (in this process or another) holds it now; never blocks."""
        with _held_lock:
            if final in _held:
                return None
            _held.add(final)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(str(final) + LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except BaseException:
            _forget(final)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process writes it
            os.close(fd)
            _forget(final)
            return None
        return cls(final, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the lock
            _forget(self.final)


def _forget(final: Path) -> None:
    with _held_lock:
        _held.discard(final)


def wait_for_writer(final: Path, header: FileHeader, stopped: threading.Event) -> bool:
    """Wait while another writer holds `final`'s lock; whether a complete copy is there then (False
    where the writer failed or was killed: the caller reads the object itself). Polls, so that
    `stopped` ends the wait at once and a writer in another process or host is seen going."""
    start = time.monotonic()
    noticed = False
    pause = 0.01
    while not complete(final, header):
        claim = Claim.take(final)
        if claim is not None:  # no writer now: the copy is complete, or its writer went without one
            claim.release()
            return complete(final, header)
        if stopped.wait(pause):
            return False
        pause = min(0.25, pause * 2)
        if not noticed and time.monotonic() - start > _NOTICE_AFTER:
            noticed = True
            writers = ", ".join(p.name.split(_PARTIAL, 1)[1] for p in _partials(final)) or "another process"
            log.info("streamload: %s: waiting for its writer (%s) to complete it", final, writers)
    return True


class CacheWriter:
    """Writes one object's bytes to a file of its own as they arrive, and completes the copy when all
    have. Holds the file's claim until it completes or is closed."""

    def __init__(self, claim: Claim, header: FileHeader, head: bytes) -> None:
        self.header = header
        self.final = claim.final
        self._claim = claim
        for stale in _partials(self.final):  # a killed writer's: no live writer holds the claim
            stale.unlink(missing_ok=True)
        self.partial = Path(f"{self.final}{_PARTIAL}{_writer_tag()}")
        self._lock = threading.Lock()
        self._written: list[tuple[int, int]] = []  # merged [start, end) ranges
        self._fd: int | None = None
        try:
            self._fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            os.ftruncate(self._fd, header.size)
            self.write(0, memoryview(head)[: header.data_start])
        except BaseException:
            self.close()
            raise

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
        made = _file(os.fstat(fd))
        os.close(fd)
        self._fd = None
        record = Path(str(self.final) + RECORD)
        tmp = Path(f"{self.partial}.record")  # this writer's own (a killed one's goes with its partial file)
        tmp.write_text(json.dumps({**_record(self.header), **made}))
        os.replace(tmp, record)  # names an inode `final` is not yet: nothing looks complete before the next line
        os.replace(self.partial, self.final)
        self._claim.release()

    def close(self) -> None:
        """Drop an incomplete copy (a complete one was renamed already) and the claim."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
                self.partial.unlink(missing_ok=True)
            self._claim.release()


class _Awaited:
    """A file another writer is writing: the first reader thread that needs it waits, the rest wait on it."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.lock = threading.Lock()
        self.done = False


class Copies:
    """What one load does with the cache for each object it reads: reads a complete copy (`local`),
    writes the copy as the bytes stream past (`write`), or waits for the writer another process (or
    load) is and then reads its copy. Files the load reads in part (`partly`) are neither written nor
    waited for: a copy is whole or absent."""

    def __init__(
        self, cache_dir: Path, headers: dict[PurePath, FileHeader], heads: dict[PurePath, bytes], partly: Iterable
    ) -> None:
        self._headers = headers
        self._fds: dict[PurePath, int] = {}
        self._writers: dict[PurePath, CacheWriter] = {}
        self._awaited: dict[PurePath, _Awaited] = {}
        self.stopped = threading.Event()
        skip = set(partly)
        try:
            wanted = {p: cache_path(cache_dir, p) for p in headers if p not in skip}
            wanted = {p: final for p, final in wanted.items() if not self._open(p, final)}
            claims = _claim_all(wanted)
            for path, claim in claims.items():
                if self._open(path, claim.final):  # completed since it was looked at
                    claim.release()
                else:
                    self._writers[path] = CacheWriter(claim, headers[path], heads[path])
            if not claims:
                self._awaited = {p: _Awaited(final) for p, final in wanted.items()}
        except BaseException:
            self.close()
            raise

    def local(self, path: PurePath) -> int | None:
        """A descriptor of the complete copy of `path` to read from, after waiting for its writer where
        another one writes it; None where the object itself must be read."""
        fd = self._fds.get(path)
        awaited = self._awaited.get(path)
        if fd is not None or awaited is None:
            return fd
        with awaited.lock:
            if not awaited.done:
                awaited.done = True
                if wait_for_writer(awaited.final, self._headers[path], self.stopped):
                    self._open(path, awaited.final)
            return self._fds.get(path)

    def write(self, path: PurePath, offset: int, data: memoryview) -> None:
        writer = self._writers.get(path)
        if writer is not None:
            writer.write(offset, data)

    def close(self) -> None:
        self.stopped.set()
        for writer in self._writers.values():
            writer.close()
        for fd in self._fds.values():
            os.close(fd)
        self._writers, self._fds = {}, {}

    def _open(self, path: PurePath, final: Path) -> bool:
        """Open `final` if it is a complete copy; checked on the descriptor, so that a newer version
        renamed over it meanwhile cannot slip in between the check and the reads."""
        try:
            fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            ok = _vouched(final, os.fstat(fd), self._headers[path])
        except OSError:
            ok = False
        if ok:
            self._fds[path] = fd
        else:
            os.close(fd)
        return ok


def _claim_all(wanted: dict[PurePath, Path], tries: int = 3) -> dict[PurePath, Claim]:
    """Every claim, or none: a load either writes every copy it lacks or waits for other writers and
    writes nothing. A load that wrote some files while waiting for others could wait for a load that
    waits for it (each reads layer by layer across the shards)."""
    for attempt in range(tries):
        claims: dict[PurePath, Claim] = {}
        for path, final in sorted(wanted.items(), key=lambda kv: str(kv[1])):
            claim = Claim.take(final)
            if claim is None:
                break
            claims[path] = claim
        else:
            return claims
        for claim in claims.values():
            claim.release()
        if not claims:  # another writer holds the first file: it writes; this load waits for it
            break
        time.sleep(0.01 * (1 + attempt) * (0.5 + random.random()))  # two loads took a file each: try again
    return {}


def _partials(final: Path) -> list[Path]:
    try:
        return [p for p in final.parent.iterdir() if p.name.startswith(final.name + _PARTIAL)]
    except OSError:
        return []


def _record(header: FileHeader) -> dict[str, object]:
    """What identifies the version of an object that was copied: its size and ETag (or Last-Modified)."""
    return {"size": header.size, "version": ":".join(str(x) for x in header.identity[1:])}


def _file(st: os.stat_result) -> dict[str, int]:
    """Which file a record vouches for: its inode and modification time (a file put in its place, even
    one that reuses the inode number, has another)."""
    return {"inode": st.st_ino, "mtime_ns": st.st_mtime_ns}


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
