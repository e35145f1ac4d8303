"""Local files: listing, headers by `pread`, and the descriptors and mappings the local readers use."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from streamload.base.errors import HeaderError, MissingFileError, ReadError, SourceError, StreamloadError
from streamload.format.header import FIRST_READ, FileHeader, FileVersion, header_from
from streamload.storage.base import (
    INDEX_NAME,
    Copied,
    Digest,
    Listing,
    Partly,
    Source,
    file_list,
    is_hex,
    is_index,
    parse_index,
)

if TYPE_CHECKING:
    import torch


class LocalStorage:
    """Files on a local (or locally mounted) file system."""

    local = True
    first_batch = 0  # a slot arrives in milliseconds

    def locate(self, source: Source) -> Listing:
        if isinstance(source, (str, os.PathLike)):
            try:
                return _located(Path(source))
            except StreamloadError:
                raise
            except OSError as exc:  # a folder this user may not list or enter: pathlib's bare PermissionError
                raise SourceError(f"{source}: cannot list or read: {exc.strerror or exc}") from exc
        return file_list([Path(p) for p in source])

    def header(self, path: PurePath) -> FileHeader:
        """One `fstat` and usually one `pread`."""
        fd = open_regular(Path(path))
        try:
            st = os.fstat(fd)
            head = _pread_exact(fd, path, min(st.st_size, FIRST_READ), 0)
            header = header_from(path, st.st_size, head, lambda offset, n: _pread_exact(fd, path, n, offset))
        finally:
            os.close(fd)
        return header._replace(identity=file_identity(st))

    def open(self, headers: dict[PurePath, FileHeader], partly: Partly = None) -> LocalFiles:
        return LocalFiles(headers)

    def cached(self, headers: tuple[FileHeader, ...]) -> Copied | None:
        return None  # already local

    def digest(self, header: FileHeader) -> Digest | None:
        """In a Hugging Face hub cache, `snapshots/<rev>/<file>` links to `blobs/<sha256 of the file>`."""
        target = Path(os.path.realpath(header.path))
        name = target.name
        if target.parent.name == "blobs" and len(name) == 64 and is_hex(name):
            return Digest("sha256", name, f"the Hugging Face cache's blob name ({target})")
        return None

    def held_until_checked(self) -> LocalStorage:
        return self  # nothing it serves waits for a verdict

    def sidecar(self, near: PurePath, name: str) -> bytes | None:
        try:
            return (Path(near).parent / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceError(f"{Path(near).parent / name}: cannot read: {exc.strerror or exc}") from None


def _located(path: Path) -> Listing:
    """The files of a local file, folder (its index when present) or index."""
    if path.is_dir():
        index = path / INDEX_NAME
        if index.is_file():
            return _from_index(index)
        with os.scandir(path) as entries:  # raises where it cannot list (pathlib's glob would find nothing)
            found = sorted(path / e.name for e in entries if e.name.endswith(".safetensors"))
        if not found:
            raise SourceError(f"{path}: directory holds no *.safetensors file")
        for file in found:  # the rule an index's shards follow: a folder's listing is no way around it
            _inside(file, path, path)
        return Listing(found)
    if is_index(path.name) and path.is_file():
        return _from_index(path)
    if not path.exists():
        raise MissingFileError(f"{path}: no such file or directory")
    return Listing([path])


def _from_index(index: Path) -> Listing:
    try:
        listing = parse_index(index, index.read_bytes())
    except OSError as exc:
        raise SourceError(f"{index}: cannot read the index: {exc}") from None
    for shard in listing.files:
        if not Path(shard).is_file():
            raise MissingFileError(f"{index}: shard {shard.name} is missing")
        _inside(Path(shard), index.parent, index)
    return listing


def _inside(file: Path, folder: Path, where: Path) -> None:
    """Refuse `file` (of `folder`, found through `where`: an index or the folder) where it is a link out of
    the checkpoint's folder; a Hugging Face cache's snapshot links into its `blobs` are the one exception."""
    root = folder.resolve()
    blobs = root.parent.parent / "blobs"  # a Hugging Face cache: snapshots/<rev>/<file> -> ../../blobs/<sha256>
    if file.resolve().parent not in (root, blobs):
        what = f"shard {file.name}" if where != folder else file.name
        raise SourceError(f"{where}: {what} links outside the checkpoint's directory")


def open_regular(path: Path) -> int:
    """Open a file for reading; refuse anything but a regular file (a FIFO would hang a read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise SourceError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_identity(st: os.stat_result) -> FileVersion:
    return FileVersion(st.st_size, device=st.st_dev, inode=st.st_ino, mtime_ns=st.st_mtime_ns)


def pread_full(fd: int, length: int, offset: int) -> memoryview:
    """`length` bytes of `fd` at `offset`; fewer only where the file ends first (an OSError is the caller's to name)."""
    view = memoryview(bytearray(length))
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            return view[:done]
        done += n
    return view


def _pread_exact(fd: int, path: PurePath, count: int, offset: int) -> bytes:
    try:
        data = pread_full(fd, count, offset)
    except OSError as exc:
        raise ReadError(f"{path}: reading the header failed: {exc.strerror or exc}") from exc
    if len(data) < count:
        raise HeaderError(f"{path}: file ended while reading its header")
    return bytes(data)


class LocalFiles:
    """File descriptors (and, on demand, private read-only mappings) of the files a plan reads.

    Closing drops the descriptors; a mapping stays alive as long as a tensor viewing it does.
    """

    def __init__(self, headers: dict[PurePath, FileHeader]) -> None:
        self._headers = headers
        self._fds: dict[PurePath, int] = {}
        self._maps: dict[PurePath, torch.UntypedStorage] = {}
        self._direct: dict[PurePath, int | None] = {}
        self._lock = threading.Lock()
        try:
            for path, header in headers.items():
                self._fds[path] = fd = open_regular(Path(path))
                st = os.fstat(fd)
                if st.st_size != header.size:
                    raise ReadError(f"{path}: file is now {st.st_size} bytes, not the {header.size} its header said")
                if header.identity and file_identity(st) != header.identity:
                    raise ReadError(f"{path}: file was replaced or modified after its header was read")
        except BaseException:
            self.close()
            raise

    def fd(self, path: PurePath) -> int:
        return self._fds[path]

    def read(self, path: PurePath, offset: int, length: int) -> list[memoryview]:
        try:
            view = pread_full(self._fds[path], length, offset)
        except OSError as exc:
            raise ReadError(f"{path}: reading bytes {offset}..{offset + length} failed: {exc.strerror or exc}") from exc
        if len(view) < length:
            raise ReadError(f"{path}: file is shorter than its header says (truncated?)")
        return [view]

    def mapping(self, path: PurePath) -> torch.UntypedStorage:
        with self._lock:
            storage = self._maps.get(path)
            if storage is None:
                # shared=False: MAP_PRIVATE, so writes to a tensor never reach the file (copy on write).
                # Mapped through our descriptor, not the name: the very file whose header was read.
                name = f"/proc/self/fd/{self._fds[path]}"
                if not os.path.exists(name):  # no /proc: the name it is
                    name = str(path)
                size = self._headers[path].size
                import torch  # (listing and headers need none: a fetch process imports no torch)

                storage = torch.UntypedStorage.from_file(name, shared=False, nbytes=size)
                self._maps[path] = storage
            return storage

    def direct_fd(self, path: PurePath) -> int | None:
        """The same file opened again with O_DIRECT (through our descriptor, so the very file whose
        header was read), or None where the file system does not allow it."""
        with self._lock:
            if path not in self._direct:
                self._direct[path] = self._open_direct(path)
            return self._direct[path]

    def _open_direct(self, path: PurePath) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        name = f"/proc/self/fd/{self._fds[path]}"
        if not flag or not os.path.exists(name):
            return None
        try:
            fd = os.open(name, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # EINVAL: tmpfs and others refuse O_DIRECT
            return None
        if file_identity(os.fstat(fd)) != file_identity(os.fstat(self._fds[path])):
            os.close(fd)
            raise ReadError(f"{path}: file was replaced or modified after its header was read")
        return fd

    def cancel(self) -> None:
        pass  # a local read ends on its own within one chunk

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        direct, self._direct = self._direct, {}
        self._maps = {}
        for fd in [*fds.values(), *direct.values()]:
            if fd is not None:
                os.close(fd)
