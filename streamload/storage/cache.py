"""A local copy of objects, written as their bytes stream past, so that the next load is local.

Layout: `cache_dir/<scheme>/<bucket or host>/<key>`, beside it `<key>.streamload.json` (the object's
size and ETag or Last-Modified, the copy's inode and mtime) and `<key>.lock`, held by `<key>`'s writer.

Processes on one host or on several (over a shared file system) fill and read one cache at once:
- one writer per file: the process holding the file's `flock` (dropped by the kernel when it dies;
  over NFS a lock the server keeps). Others wait for its copy (`Copies.local`) instead of downloading
  again; where it dies, the first load to find the lock free writes the copy from the bytes it reads,
  and from then on waits for no other writer, so no two loads wait for each other;
- a writer writes a file of its own (`<key>.partial.<host>.<pid>.<random>`) and renames it to `<key>`
  once every byte is on disk, after its record. A copy is complete only if its record names the
  object's version and the copy's inode and mtime, so a killed writer leaves nothing that looks
  complete (the next writer removes its partial file). A newer version replaces a copy by a rename:
  a reader of the old one keeps its bytes;
- a writer whose partial file has not changed for `WRITER_STALL` seconds (stopped, or hung on a dead
  mount) is given up on: the load reads what it lacks from the store (one warning);
- a file a load reads in part (`include=`, `shard=`, a cooperative load's shared batches) is neither
  written nor waited for: no such load could complete its copy.

Shared between users:
- nothing is reached through a symlink: each folder under `cache_dir` is opened from the one above it
  (`O_DIRECTORY|O_NOFOLLOW`, `dir_fd=`), once a load, and every file through its folder's descriptor
  (`O_NOFOLLOW`; new files `O_EXCL`). Behind a link another user put there, the load reads from the
  store, and one warning names the link;
- a copy another user wrote is not read unchecked (`own`); a lock file of theirs is opened read-only
  (`flock` needs no write access). A cache that several users fill wants a setgid directory and umask 002;
- a copy that cannot be kept (a full disk, a quota, a folder this user cannot write) is dropped,
  nothing of it left, and the load reads from the store (one warning a load).

NFS mounted with `nolock` or `local_lock=flock|all` (/proc/self/mountinfo) locks on each host alone, so
two hosts would both write a file. There nothing is locked nor waited for: each load writes the copies
it lacks under its own name and renames them into place (the last wins; a record naming another inode
makes the copy incomplete), and no partial file is removed as stale (delete `*.partial.*` while no
load runs). A warning names the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePath

from streamload.base import atomic
from streamload.base.atomic import FOLDER, NEW, PARTIAL, writer_tag
from streamload.format.header import FileHeader
from streamload.storage.verified import Verified, covered, gaps, merged, register, unregister

RECORD = ".streamload.json"
_RECORD_MAX = 1 << 16  # bytes of a record read at most (one is ~120)
LOCK = ".lock"
_NOTICE_AFTER = 5.0  # seconds of waiting for another writer before it is logged
WRITER_STALL = 180.0  # seconds a writer may leave its partial file unchanged before its readers give up on it
MOUNTINFO = Path("/proc/self/mountinfo")

log = logging.getLogger("streamload")
_held: set[Path] = set()  # the files this process holds the lock of (an NFS lock is per process, not per fd)
_held_lock = threading.Lock()
_lock_scopes: dict[Path, str | None] = {}  # cache directory: why its locks are this host's only (None: shared)


def cache_path(cache_dir: Path, path: PurePath) -> Path:
    """Where the copy of the object at `path` (an ObjectPath) lives."""
    return cache_dir.joinpath(*_names(path))


def _names(path: PurePath) -> list[str]:
    """The folders under the cache directory that hold the copy of the object at `path`, then its name."""
    scheme, host, *key = path.parts
    return [scheme.rstrip(":"), host.replace(":", "_"), *PurePath(*key).parts]


class Linked(OSError):
    """A symbolic link where the cache has a folder or a file of its own (another user's, in a shared
    cache: it would have this process read, create or replace files elsewhere)."""

    def __init__(self, path: Path) -> None:
        super().__init__(errno.ELOOP, "a symbolic link where the cache keeps a folder or file of its own", str(path))


def _refused(parent: int, name: str, path: Path, exc: OSError) -> OSError:
    """What opening `name` in `parent` without following it failed with: `Linked` where it is a link."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return exc
    return Linked(path) if stat.S_ISLNK(st.st_mode) else exc


class Place:
    """Where one file of the cache goes: its folder, open (`Folders`), and its name there. Every file of
    it (`<name><suffix>`: the copy, its record, its lock, partial files) is reached through the folder's
    descriptor, never through a link. `path` names it in messages and keys this process's locks."""

    __slots__ = ("folder", "name", "path")

    def __init__(self, folder: int, name: str, path: Path) -> None:
        self.folder, self.name, self.path = folder, name, path

    def open(self, suffix: str, flags: int, mode: int = 0o666) -> int:
        return os.open(self.name + suffix, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.folder)

    def stat(self, suffix: str = "") -> os.stat_result:
        return os.stat(self.name + suffix, dir_fd=self.folder, follow_symlinks=False)

    def unlink(self, suffix: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # a link is removed, never what it points to
            os.unlink(self.name + suffix, dir_fd=self.folder)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.name + src, self.name + dst, src_dir_fd=self.folder, dst_dir_fd=self.folder)

    def suffixes(self, start: str) -> list[str]:
        """The suffixes of the files in the folder named `<name><start>...`."""
        with contextlib.suppress(OSError):
            fd = os.open(".", FOLDER, dir_fd=self.folder)  # anew: a listing's position is its descriptor's
            try:
                return [n[len(self.name) :] for n in os.listdir(fd) if n.startswith(self.name + start)]
            finally:
                os.close(fd)
        return []

    def linked(self) -> Linked | None:
        """A link where the copy, its record or its lock goes, if there is one."""
        for suffix in ("", RECORD, LOCK):
            try:
                if stat.S_ISLNK(self.stat(suffix).st_mode):
                    return Linked(Path(f"{self.path}{suffix}"))
            except OSError:
                pass
        return None


class Folders:
    """The folders of one cache that a load (or a lookup) uses: each opened once, from the one above it
    without following a link, made where `create` and absent, and kept open until `close`. The cache
    directory itself is the caller's, links and all."""

    def __init__(self, cache_dir: Path, create: bool) -> None:
        self.cache_dir = cache_dir
        self._create = create
        self._open: dict[tuple[str, ...], int] = {}

    def place(self, path: PurePath) -> Place:
        """Where the copy of the object at `path` goes. Raises `Linked` where a link is in the way (a
        folder, or the copy, record or lock), another OSError where a folder cannot be opened or made."""
        *folders, name = _names(path)
        where = cache_path(self.cache_dir, path)
        if name in ("", ".", ".."):  # (a folder's name is checked as it is opened)
            raise OSError(errno.EINVAL, "not a name the cache keeps a copy under", str(where))
        place = Place(self.folder(tuple(folders)), name, where)
        linked = place.linked()
        if linked is not None:
            raise linked
        return place

    def folder(self, names: tuple[str, ...]) -> int:
        fd = self._open.get(names)
        if fd is not None:
            return fd
        if names:
            parent, name, path = self.folder(names[:-1]), names[-1], self.cache_dir.joinpath(*names)
            if name in ("", ".", "..") or "/" in name:
                raise OSError(errno.EINVAL, "not a name the cache keeps a folder under", str(path))
            try:
                fd = atomic.subfolder(parent, name, self._create)  # never through a link
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise _refused(parent, name, path, exc) from exc
        else:
            if self._create:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._open[names] = fd
        return fd

    def close(self) -> None:
        fds, self._open = self._open, {}
        for fd in fds.values():
            os.close(fd)


def complete(place: Place, header: FileHeader) -> bool:
    """Whether the file at `place` is a whole copy of the version of the object whose header was read."""
    try:
        return _vouched(place, place.stat(), header)  # a symlink is no copy (`Copies._open` opens none)
    except OSError:
        return False


def open_copy(place: Place, suffix: str = "") -> int:
    """`<name><suffix>` at `place` opened read-only where it is a regular file with one link (`single`);
    else OSError. Opened with `O_NONBLOCK` (a FIFO put there would block the open until a writer came),
    cleared once the descriptor is known to be a file's."""
    fd = place.open(suffix, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not single(os.fstat(fd)):
            raise OSError(errno.EINVAL, "not a regular file with one link", f"{place.path}{suffix}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def single(st: os.stat_result) -> bool:
    """Whether `st` is a file the cache may have written: a regular file (not a FIFO, a device, a socket)
    with one link. A hard link is another name for a file elsewhere (whoever holds the other name may
    change it; one linked in with a forged record would be served as a copy), and the cache makes none."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def own(place: Place, st: os.stat_result) -> bool:
    """Whether the copy `st` describes and its record at `place` are this user's: this user's loads keep
    only bytes read from the origin or checked (another user's could hold anything)."""
    return st.st_uid == os.geteuid() and place.stat(RECORD).st_uid == os.geteuid()


def _vouched(place: Place, st: os.stat_result, header: FileHeader) -> bool:
    """Whether the record at `place` vouches for the file `st` describes as a whole copy of `header`'s version."""
    return single(st) and st.st_size == header.size and _read_record(place) == {**version_of(header), **_file(st)}


def _read_record(place: Place) -> object:
    """The record at `place` as written (JSON), or None where there is none or it cannot be read."""
    try:
        fd = open_copy(place, RECORD)  # a FIFO or a device there is no record, and never blocks
        with open(fd, "rb") as f:
            data = f.read(_RECORD_MAX + 1)
        return json.loads(data) if len(data) <= _RECORD_MAX else None
    except (OSError, ValueError):
        return None


def record_of(place: Place, st: os.stat_result) -> dict[str, object] | None:
    """The record at `place` where it vouches for the file `st` describes as a whole copy, whatever
    version it names (a seeder's question); else None."""
    record = _read_record(place) if single(st) else None
    vouched = isinstance(record, dict) and set(record) == {"size", "version", *_file(st)}
    return record if vouched and record == {**record, "size": st.st_size, **_file(st)} else None


def version_of(header: FileHeader) -> dict[str, object]:
    """What identifies the version of an object that was copied: its size and ETag (or Last-Modified)."""
    assert header.identity is not None, header.path  # an object's header always names its version
    return {"size": header.size, "version": header.identity.recorded()}


def lookup(cache_dir: Path, headers: Sequence[FileHeader]) -> list[Path] | None:
    """The local copies of every file, if the cache holds all of them complete at the versions whose
    headers were just read; else None (never waits: files being written are the load's to wait for)."""
    if len(kept(cache_dir, headers)) < len(headers):
        return None
    return [cache_path(cache_dir, h.path) for h in headers]


def kept(cache_dir: Path, headers: Sequence[FileHeader]) -> list[FileHeader]:
    """The files of which the cache holds a complete copy now, at the versions whose headers were read
    (a link in the way is no copy, nor a FIFO, a device or a hard link; one still being written is none yet)."""
    folders = Folders(cache_dir, create=False)
    whole = []
    try:
        for h in headers:
            with contextlib.suppress(OSError):  # a folder absent, or a link in the way
                if complete(folders.place(h.path), h):
                    whole.append(h)
    finally:
        folders.close()
    return whole


def keep(local: Path, data: bytes, root: Path) -> None:
    """A small file (an index, a digest file) into the cache directory `root` whole: written under a
    name of this writer's own, then renamed, through folders walked as a load walks them. Where it
    cannot be kept (a full disk, another user's directory, a link), the caller goes on without it."""
    try:
        folders = Folders(root, create=True)
        try:
            names = local.relative_to(root).parts
            atomic.write(Path(names[-1]), data, dir_fd=folders.folder(names[:-1]))
        finally:
            folders.close()
    except (OSError, ValueError) as exc:
        log.warning("streamload: %s: not kept in the cache: %s", local, exc)


def lock_scope(directory: Path, mountinfo: str) -> str | None:
    """Why `flock` in `directory` is seen on this host only (e.g. "nfs mounted with nolock,local_lock=all"),
    from the lines of /proc/self/mountinfo; None where other hosts see it (or there are none)."""
    where = _resolved(directory)
    point, fstype, options = "", "", [""]
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        end = fields.index("-", 6)
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # spaces, tabs...: octal escapes
        under = where == mount or where.startswith(mount.rstrip("/") + "/")
        if len(fields) > end + 3 and under and len(mount) >= len(point):  # later mounts hide earlier
            point, fstype, options = mount, fields[end + 1], fields[end + 3].split(",")
    local = [o for o in options if o in ("nolock", "local_lock=flock", "local_lock=all")]
    return f"{fstype} mounted with {','.join(local)}" if fstype.startswith("nfs") and local else None


def _resolved(directory: Path) -> str:
    """`directory`'s real path, through its nearest existing ancestor (the cache may not exist yet)."""
    path = directory.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.path.realpath(path) + str(directory.absolute())[len(str(path)) :]


def shared_locks(cache_dir: Path) -> bool:
    """Whether other hosts see this host's locks in `cache_dir` (see the module's docstring); warns once
    a directory where they do not."""
    if cache_dir not in _lock_scopes:
        mountinfo = ""
        with contextlib.suppress(OSError):  # not Linux: nothing says otherwise
            mountinfo = MOUNTINFO.read_text()
        scope = _lock_scopes[cache_dir] = lock_scope(cache_dir, mountinfo)
        if scope is not None:
            log.warning(
                "streamload: cache_dir %s is on %s: its locks are not seen by other hosts, so each load "
                "writes the copies it lacks itself, never waiting for another nor removing another's "
                "partial file (those of killed loads stay: remove *.partial.* while no load runs)", cache_dir, scope,
            )  # fmt: skip
    return _lock_scopes[cache_dir] is None


class Claim:
    """The right to write one file of the cache: its lock, held by this process and no other. A claim
    taken without a lock (`locks=False`: NFS without shared locks) is this process's only."""

    def __init__(self, place: Place, fd: int | None) -> None:
        self.place = place
        self._fd = fd
        self._holding = True
        self.exclusive = fd is not None  # no other process writes it: other partial files are killed writers'

    @classmethod
    def take(cls, place: Place, locks: bool = True) -> Claim | None:
        """The claim, if no other writer (in this process or another) holds it now; never blocks.
        Raises OSError where the lock cannot be taken at all (a symlink in its place, a directory this
        user cannot write, a file system without locks)."""
        with _held_lock:
            if place.path in _held:
                return None
            _held.add(place.path)
        try:
            fd = _locked(place) if locks else None
        except BaseException:
            _forget(place.path)
            raise
        if locks and fd is None:
            _forget(place.path)
            return None
        return cls(place, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # while held: no lock file outlives its use (where this user may)
                if _is_at(self.place, fd):
                    self.place.unlink(LOCK)
            os.close(fd)  # drops the lock
        if self._holding:
            self._holding = False
            _forget(self.place.path)


def _locked(place: Place) -> int | None:
    """A descriptor holding the lock of the copy at `place`; None where another process holds it. Its
    holder removes the lock file as it lets go (`Claim.release`): a lock taken on a file no longer at the
    path (removed, or removed and made anew, between this process opening it and locking it) locks
    nothing anyone else sees, so it is let go and the path's file taken instead."""
    while True:
        fd = _open_lock(place)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process writes it
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _is_at(place, fd):
            return fd
        os.close(fd)


def _is_at(place: Place, fd: int) -> bool:
    """Whether the file open at `fd` is the lock file at `place` now."""
    try:
        at, held = place.stat(LOCK), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


def _open_lock(place: Place) -> int:
    """The lock file, never through a symlink (one put there would have this process create or lock a
    file elsewhere); read-only where another user made it (`flock` needs no write access)."""
    try:
        return place.open(LOCK, os.O_RDWR | os.O_CREAT)
    except PermissionError:
        return place.open(LOCK, os.O_RDONLY)
    except OSError as exc:
        raise _refused(place.folder, place.name + LOCK, Path(f"{place.path}{LOCK}"), exc) from exc


def held_here(final: Path) -> bool:
    """Whether a load of this process holds the claim of the copy at `final` (it writes it)."""
    with _held_lock:
        return final in _held


def _forget(final: Path) -> None:
    with _held_lock:
        _held.discard(final)


class WriterStalled(Exception):
    """The writer a load waits for has not written for `WRITER_STALL` seconds (stopped, or hung)."""


def wait_for_writer(
    place: Place, header: FileHeader, stopped: threading.Event, locks: bool, writing: threading.Event
) -> Claim | None:
    """Wait while another writer holds the lock of the copy at `place`. Returns the claim where that
    writer went without completing the copy (killed, or failed): the caller writes it or releases the
    claim. Else None, once the copy is complete or the wait ends without it (`stopped`; `writing` set:
    a writer waits for no other; the lock cannot be taken at all): the caller opens the copy if it is
    complete, else reads the object. Polls, so that `stopped` ends the wait at once and a writer on
    another host is seen going. Raises WriterStalled where the writer's partial file stays unchanged."""
    start = changed = time.monotonic()
    seen = _progress(place)
    noticed = False
    pause = 0.01
    while not complete(place, header):
        try:
            claim = Claim.take(place, locks)
        except OSError:  # whether a writer is there cannot be told: the object is read from the store
            return None
        if claim is not None:  # no writer now: the copy is complete, or its writer went without one
            if complete(place, header):
                claim.release()
                return None
            return claim
        if held_here(place.path):  # the writer is another load of this process: its reads may need the reader
            return None  # threads this wait would hold (it stalled both until WRITER_STALL); read the object
        if writing.is_set() or stopped.wait(pause):
            return None
        pause = min(0.25, pause * 2)
        now, progress = time.monotonic(), _progress(place)
        if progress != seen:
            seen, changed = progress, now
        elif now - changed > WRITER_STALL:
            raise WriterStalled(f"{place.path}: its writer ({_writers(place)}) wrote nothing for {WRITER_STALL:g} s")
        if not noticed and now - start > _NOTICE_AFTER:
            noticed = True
            log.info("streamload: %s: waiting for its writer (%s) to complete it", place.path, _writers(place))
    return None


def _progress(place: Place) -> list[tuple[str, int, int]]:
    """What changes while a writer writes the copy at `place`: its partial files' names, mtimes and blocks."""
    out = []
    for suffix in place.suffixes(PARTIAL):
        with contextlib.suppress(OSError):  # gone meanwhile
            st = place.stat(suffix)
            out.append((suffix, st.st_mtime_ns, st.st_blocks))
    return sorted(out)


def _writers(place: Place) -> str:
    return ", ".join(s.split(PARTIAL, 1)[1] for s in place.suffixes(PARTIAL)) or "another process"


def _reserve(fd: int, size: int) -> None:
    """The file's whole size, reserved on disk before its first byte is written: a full disk fails
    the copy at its start (the load goes on without it), not midway, nor another writer's later
    (a sparse file's blocks are taken as they are written: the space checked once is not kept)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a file system that cannot reserve: sparse, as before


class CacheWriter:
    """Writes one object's bytes to a file of its own as they arrive, and completes the copy when all
    have. Holds the file's claim until it completes or is closed. An OSError (a full disk) is raised
    with nothing of the copy left: the caller goes on without it. What of it passed the integrity layer is
    marked as it is written (`write`'s `checked`) for this process's seeder, which serves those ranges while
    the copy is in progress (storage/verified.py); they are read back (`read_verified`) until it is closed."""

    def __init__(self, claim: Claim, header: FileHeader) -> None:
        self.header = header
        self.final = claim.place.path
        self._place = place = claim.place
        self._claim = claim
        if claim.exclusive:
            for stale in place.suffixes(PARTIAL):  # a killed writer's: no live writer holds the claim
                place.unlink(stale)
        self._partial = f"{PARTIAL}{writer_tag()}"  # the suffix of this writer's own file
        self._lock = threading.Lock()
        self._written: list[tuple[int, int]] = []  # merged [start, end) ranges
        self._fd: int | None = None
        self._done = False  # complete: renamed into place (its descriptor still read until `close`)
        self.verified: Verified | None = None
        try:
            self._fd = place.open(self._partial, (NEW & ~os.O_WRONLY) | os.O_RDWR)  # read back: `read_verified`
            _reserve(self._fd, header.size)
            self.write(0, memoryview(header.prefix))  # the length word and header, as read
            self.verified = Verified(header, self._fd)
            register(place.folder, place.name, self.verified)
        except BaseException:
            self.close()
            raise

    def write(self, offset: int, data: memoryview, checked: bool = False) -> None:
        """Bytes at `offset`; `checked`: they passed the integrity layer (marked so once on disk, before the copy
        can complete). Bytes on disk already are not written again, nor marked: what was written unchecked
        stays so."""
        with self._lock:
            fd = self._fd
            if fd is None or self._done or covered(self._written, offset, offset + len(data)):
                return  # (bytes on disk already: a segment this load verified, read back from here)
            for lo, hi in gaps(self._written, offset, offset + len(data)):  # never over verified bytes
                done = lo
                while done < hi:
                    done += os.pwrite(fd, data[done - offset : hi - offset], done)
                if checked and self.verified is not None:
                    self.verified.mark(lo, hi)
            self._written = merged([*self._written, (offset, offset + len(data))])
            if self._written == [(0, self.header.size)]:
                self._complete(fd)

    def read_verified(self, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) as written, where they were verified; else None."""
        with self._lock:
            if self._fd is None or self.verified is None or not self.verified.covers(start, end):
                return None
            data = bytearray(end - start)
            got = os.preadv(self._fd, [data], start)
        return memoryview(data) if got == len(data) else None

    def _complete(self, fd: int) -> None:
        """Record, then rename; where either fails, `close` drops the partial file (the record then
        names an inode no copy has)."""
        os.fsync(fd)
        made = _file(os.fstat(fd))
        record = json.dumps({**version_of(self.header), **made}).encode()
        # The record's temporary file is this writer's own (a killed one's goes with its partial file); the
        # record names an inode the copy's name is not yet: nothing looks complete before the second rename.
        name, folder = self._place.name, self._place.folder
        atomic.write(Path(name + RECORD), record, temporary=Path(f"{name}{self._partial}.record"), dir_fd=folder)
        self._place.rename(self._partial, "")
        self._done = True  # a seeder serves the complete copy from now on
        self._unregister()
        self._claim.release()

    def _unregister(self) -> None:
        if self.verified is not None:
            self.verified.end()
            unregister(self._place.folder, self._place.name, self.verified)

    def close(self) -> None:
        """Drop an incomplete copy (a complete one was renamed already) and the claim."""
        with self._lock:
            self._unregister()  # before its descriptor goes: no seeder dups a closed one
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
                if not self._done:
                    self._place.unlink(self._partial)
            self._claim.release()


class Copies:
    """What one load does with the cache for each object it reads: reads a complete copy (`local`),
    writes the copy as the bytes stream past (`write`), or waits for the writer another process (or
    load) is and then reads its copy. Files the load reads in part (`partly`) are neither written nor
    waited for. A copy that cannot be written is dropped; a link in the way of one, or a writer that
    stalls, makes the load read from the store (one warning each)."""

    def __init__(self, cache_dir: Path, headers: dict[PurePath, FileHeader], partly: Iterable) -> None:
        self._cache_dir = cache_dir
        self._headers = headers
        self._folders = Folders(cache_dir, create=True)
        self._fds: dict[PurePath, int] = {}
        self._writers: dict[PurePath, CacheWriter] = {}
        # files another writer writes: the first reader thread that needs one waits, the rest on its lock
        self._awaited: dict[PurePath, tuple[Place, threading.Lock]] = {}
        self._settled: set[PurePath] = set()
        self.stopped = threading.Event()
        self._warned: set[type] = set()  # the kinds of warning this load gave (one of each)
        self._warned_lock = threading.Lock()
        self._stalled = False  # a writer it waited for stalled: it waits for none any more
        self._writing = threading.Event()  # it writes a copy another writer left: it waits for none any more
        self._locks = shared_locks(cache_dir)
        skip = set(partly)
        try:
            wanted = self._places([p for p in headers if p not in skip])
            wanted = {p: place for p, place in wanted.items() if not self._open(p, place)}
            claims = _claim_all(wanted, self._locks, self._not_kept)
            for path, claim in claims.items():
                if self._open(path, claim.place):  # completed since it was looked at
                    claim.release()
                else:
                    self._start_writer(path, claim)
            if not claims:  # another writer's: waited for, unless it is a load of this very process (`wait_for_writer`)
                self._awaited = {
                    p: (place, threading.Lock()) for p, place in wanted.items() if not held_here(place.path)
                }
        except BaseException:
            self.close()
            raise

    def _places(self, paths: Iterable[PurePath]) -> dict[PurePath, Place]:
        """Where each object's copy goes, its folders open; an object whose place cannot be reached (a
        link in the way, a folder this user cannot make) is read from the store, with one warning."""
        out = {}
        for path in paths:
            try:
                out[path] = self._folders.place(path)
            except Linked as exc:
                self._warn(
                    Linked, "streamload: cache_dir %s: %s is a symbolic link (another user's?): this load neither "
                    "reads nor writes copies through it, and reads %s from the store", self._cache_dir, exc.filename,
                    path,
                )  # fmt: skip
            except OSError as exc:
                self._not_kept(cache_path(self._cache_dir, path), exc)
        return out

    def local(self, path: PurePath) -> int | None:
        """A descriptor of the complete copy of `path` to read from, after waiting for its writer where
        another one writes it; None where the object itself must be read."""
        fd = self._fds.get(path)
        awaited = self._awaited.get(path)
        if fd is not None or awaited is None:
            return fd
        place, lock = awaited
        with lock:  # held until settled: no byte of the object is read before (its copy may be ours)
            if path not in self._settled:
                self._settled.add(path)
                self._settle(path, place)
            return self._fds.get(path)

    def _settle(self, path: PurePath, place: Place) -> None:
        """The copy another writer writes, opened once complete (at once where a writer stalled). Where
        that writer went without completing it, this load writes it from the bytes it reads (none read
        yet: `local` holds them back), and waits for no other writer from then on (one may wait for it)."""
        claim = None
        if not self._stalled:
            try:
                claim = wait_for_writer(place, self._headers[path], self.stopped, self._locks, self._writing)
            except WriterStalled as exc:
                self._stalled = True
                self._warn(WriterStalled, "streamload: %s; this load reads the objects it lacks from the store", exc)
        if claim is None:
            self._open(path, place)
            return
        self._writing.set()
        if self._start_writer(path, claim):
            log.info("streamload: %s: its writer went without completing it; this load writes it", place.path)

    def _start_writer(self, path: PurePath, claim: Claim) -> bool:
        try:
            self._writers[path] = CacheWriter(claim, self._headers[path])
        except OSError as exc:  # released its claim
            self._not_kept(claim.place.path, exc)
            return False
        return True

    def write(self, path: PurePath, offset: int, data: memoryview, checked: bool = False) -> None:
        """Bytes of `path` at `offset` into its copy; `checked`: they passed the integrity layer (a seeder of
        this process may serve them while the copy is in progress: storage/verified.py)."""
        writer = self._writers.get(path)
        if writer is None:
            return
        try:
            writer.write(offset, data, checked)
        except OSError as exc:  # a full disk, a quota: the bytes arrived, the load goes on without the copy
            writer.close()
            self._not_kept(writer.final, exc)

    def writes(self, path: PurePath) -> bool:
        """Whether this load writes the copy of `path` (and can mark what of it it verified)."""
        return path in self._writers

    def read_verified(self, path: PurePath, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) of `path` as this load wrote them, where it verified them; else None."""
        writer = self._writers.get(path)
        try:
            return None if writer is None else writer.read_verified(start, end)
        except OSError:  # a disk that fails reads: the bytes are fetched again
            return None

    def verified(self, path: PurePath) -> Verified | None:
        """What this load verified of the copy of `path` it writes (None where it writes none)."""
        writer = self._writers.get(path)
        return None if writer is None else writer.verified

    def drop(self, path: PurePath) -> None:
        """Write no copy of `path` (its partial file removed): bytes of it were not checked."""
        writer = self._writers.pop(path, None)
        if writer is not None:
            writer.close()
            log.info("streamload: %s: not kept in the cache (bytes of it were used unchecked)", writer.final)

    def _not_kept(self, final: Path, exc: OSError) -> None:
        self._warn(
            OSError, "streamload: cache_dir %s: cannot keep copies there (%s: %s); this load reads from the store "
            "without keeping them", self._cache_dir, final, exc,
        )  # fmt: skip

    def _warn(self, kind: type, message: str, *args: object) -> None:
        with self._warned_lock:
            first = kind not in self._warned
            self._warned.add(kind)
        (log.warning if first else log.debug)(message, *args)

    def close(self) -> None:
        """Every writer closed, then every descriptor (after every read has returned: `ObjectFiles.close`)."""
        self.stopped.set()
        for writer in list(self._writers.values()):
            writer.close()
        for fd in self._fds.values():
            os.close(fd)
        self._writers, self._fds = {}, {}
        self._folders.close()

    def _open(self, path: PurePath, place: Place) -> bool:
        """Open the copy at `place` if it is complete; checked on the descriptor, so that a newer version
        renamed over it meanwhile cannot slip in between the check and the reads."""
        try:
            fd = open_copy(place)  # a FIFO, a device or a hard link there is no copy (`single`)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            ok = _vouched(place, st, self._headers[path])
            if ok and not own(place, st):
                ok = False  # another user's: nothing checks it here (a whole cached checkpoint: `cached`)
                self._warn(PermissionError, "streamload: %s: a copy another user wrote is not read unchecked: "
                           "this load reads the object from the origin", place.path)  # fmt: skip
        except OSError:
            ok = False
        if ok:
            self._fds[path] = fd
        else:
            os.close(fd)
        return ok


def _claim_all(
    wanted: dict[PurePath, Place], locks: bool, failed: Callable[[Path, OSError], None], tries: int = 3
) -> dict[PurePath, Claim]:
    """Every claim, or none: a load either writes every copy it lacks or waits for other writers and
    writes nothing. A load that wrote some files while waiting for others could wait for a load that
    waits for it (each reads layer by layer across the shards). A file whose lock cannot be taken at
    all (`failed` is told) is left out: no one writes it through that lock."""
    wanted = dict(wanted)
    for attempt in range(tries):
        claims: dict[PurePath, Claim] = {}
        for path, place in sorted(wanted.items(), key=lambda kv: str(kv[1].path)):
            try:
                claim = Claim.take(place, locks)
            except OSError as exc:
                failed(place.path, exc)
                del wanted[path]
                continue
            if claim is None:
                break
            claims[path] = claim
        else:
            return claims
        for claim in claims.values():
            claim.release()
        if not claims:  # another writer holds the first file: it writes; this load waits for it
            break
        time.sleep(0.01 * (1 + attempt) * (0.5 + random.random()))  # nosec B311 # jitter: two loads took a file each
    return {}


def _file(st: os.stat_result) -> dict[str, int]:
    """Which file a record vouches for: its inode and modification time (a file put in its place, even
    one that reuses the inode number, has another)."""
    return {"inode": st.st_ino, "mtime_ns": st.st_mtime_ns}
