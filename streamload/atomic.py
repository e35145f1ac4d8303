"""Files and folders put in place whole, by a rename: a reader sees each whole or not at all.

`write` writes a file under a name of the writer's own beside it (`<name>.partial.<host>.<pid>.<random>`:
created new, never through a symlink, so that two writers never mix their bytes) and renames it into
place (or links it, where an existing file is never replaced); `folder` opens a folder under a root
without following links, for `write`'s `dir_fd`; `unpack` writes an archive's files and folders one by
one, as data (never `extractall`: no links, devices, or names leaving the folder), into a folder of this
process's own inside a root (`owned.py`) and renames into place what the root lacks. What fails leaves
nothing of it behind. No torch here: the fetch started before vLLM's import writes and unpacks too.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import tarfile

PARTIAL = ".partial."  # a file being written: `<name>.partial.<writer_tag()>`
NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a file of this writer's own
INSTALLING = ".streamload-installing-"  # an archive being unpacked into a root (owned.py)
FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a folder, never through a link
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK}  # a file system without hard links


def writer_tag() -> str:
    """This writer's part of a partial file's name: host, process id, and a random part."""
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def write(
    target: Path,
    data: bytes | Callable[[BinaryIO], object],
    sync: bool = False,
    temporary: Path | None = None,
    *,
    dir_fd: int | None = None,
    replace: bool = True,
) -> bool:
    """`data` put at `target` whole: written into a new file `temporary` (default: a name of this
    writer's own beside `target`), flushed to disk where `sync`, then renamed over `target`. `data` is
    the bytes, or a function that writes them into the file object it is given (an archive). `dir_fd`:
    a folder open (`folder`), `target` a name in it. `replace=False`: put in place only where `target`
    is absent, also where another writer puts one there meanwhile (a link, not a rename): False where
    it was there. Raises what fails (an OSError: a full disk), with the temporary file removed."""
    tmp = target.with_name(f"{target.name}{PARTIAL}{writer_tag()}") if temporary is None else temporary
    fd = os.open(tmp, NEW, 0o666, dir_fd=dir_fd)
    try:
        with open(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return True
        return _add(tmp, target, dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def _add(tmp: Path, target: Path, dir_fd: int | None) -> bool:
    """`tmp` put at `target` where that is absent (a link fails where a name exists; a rename would
    replace it); `tmp`'s name removed. Where the file system has no hard links: renamed where absent."""
    try:
        os.link(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(tmp, dir_fd=dir_fd)
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        try:
            os.stat(target, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.replace(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return True
        os.unlink(tmp, dir_fd=dir_fd)
        return False
    os.unlink(tmp, dir_fd=dir_fd)
    return True


def folder(root: Path, *names: str) -> int:
    """The folder `root/<names...>` open (a descriptor for `dir_fd=`; the caller closes it), each of
    `names` made where absent and opened without following a link: a link there (another user's, in a
    shared cache) raises OSError (ELOOP or ENOTDIR), and nothing is written through it. `root` is the
    caller's own path (a configured cache root), made where absent and followed as given."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, FOLDER & ~os.O_NOFOLLOW)
    try:
        for name in names:
            if name in ("", ".", "..") or "/" in name:
                raise ValueError(f"{root}: {name!r} is not a folder's name")
            inner = subfolder(fd, name)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def subfolder(parent: int, name: str, create: bool = True) -> int:
    """The folder `name` in the open folder `parent`, made first where `create` and absent, opened
    without following a link: a link there raises OSError (ELOOP or ENOTDIR), and nothing is ever made
    or written through it. FileNotFoundError where it is absent and not `create`."""
    try:
        return os.open(name, FOLDER, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o777, dir_fd=parent)
    except FileExistsError:  # made meanwhile (by another process), or a link: opened as any other
        pass
    return os.open(name, FOLDER, dir_fd=parent)


def unpack(data: bytes, root: Path, pick: Callable[[Path], Iterable[Path]], what: str = "an archive") -> list[Path]:
    """Write the tar archive `data` (uncompressed), member by member, into a folder of this process's
    own inside `root` (what an unpack killed midway left is removed first), then rename each path
    `pick` names in that folder (it is given the folder) to the same place in `root`, where `root`
    lacks it: each whole, or not at all (another process may have put it there first). The paths put
    in place; the rest is removed. Only files (mode 0644, or 0755 where executable) and folders (0755)
    are written, never through a link; an archive (`what`, in the error) holding anything else (a link,
    a device, a FIFO), a name that is absolute, holds `..` or an empty part, or names a path twice, is
    refused whole (ValueError) before a byte of it is written: it is not what `publish` packs."""
    import tarfile  # only where an archive is unpacked: the fetch process starts in milliseconds

    from . import owned  # (owned.py writes its records through `write`)

    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # uncompressed only: no gzip bomb
        members = _checked(tar.getmembers(), what)
    except tarfile.TarError as exc:
        raise ValueError(f"{what}: not an uncompressed tar archive ({exc}); nothing of it was installed") from None
    root.mkdir(parents=True, exist_ok=True)
    owned.sweep(INSTALLING, root)
    staging = owned.make(INSTALLING, root)
    added: list[Path] = []
    try:
        with tar:
            _write_members(tar, members, staging)
        for staged in pick(staging):
            if _moved(staged, root, staged.relative_to(staging).parts):
                added.append(root / staged.relative_to(staging))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return added


def _moved(staged: Path, root: Path, parts: tuple[str, ...]) -> bool:
    """`staged` renamed to `root/<parts...>` where that is absent (the root's own is never replaced),
    each folder on the way opened without following a link (`folder`): a link planted there by another
    user of a shared root makes nothing move. Whether it moved."""
    try:
        into = folder(root, *parts[:-1])
    except (OSError, ValueError):
        return False
    try:
        os.stat(parts[-1], dir_fd=into, follow_symlinks=False)
        return False  # there already
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        os.rename(staged, parts[-1], dst_dir_fd=into)
    except OSError:  # another process put it there first
        return False
    finally:
        os.close(into)
    return True


def _checked(members: list[tarfile.TarInfo], what: str) -> list[tuple[tarfile.TarInfo, tuple[str, ...]]]:
    """Each member with its name's parts, where all are files and folders under plain relative names,
    none named twice nor both a file and a folder; else ValueError naming `what` and the member."""
    out: list[tuple[tarfile.TarInfo, tuple[str, ...]]] = []
    files: set[tuple[str, ...]] = set()
    folders: set[tuple[str, ...]] = set()
    for member in members:
        parts = _parts(member.name)
        refused = _refusal(member, parts, files, folders)
        if refused:
            raise ValueError(
                f"{what}: member {member.name!r} {refused}: only files and folders are unpacked; "
                "nothing of it was installed"
            )
        assert parts is not None
        (files if member.isreg() else folders).add(parts)
        folders.update(parts[:k] for k in range(1, len(parts)))
        out.append((member, parts))
    return out


def _refusal(
    member: tarfile.TarInfo, parts: tuple[str, ...] | None, files: set[tuple[str, ...]], folders: set[tuple[str, ...]]
) -> str:
    """Why `member` (its name's `parts`; `files` and `folders` those of the members before it) is
    refused, or "" where it is not."""
    if not (member.isreg() or member.isdir()):
        return "is " + _kind(member)
    if parts is None or (member.isreg() and not parts):
        return "is not a plain relative name (absolute, `..` or an empty part)"
    if parts in files or (member.isreg() and parts in folders) or any(parts[:k] in files for k in range(1, len(parts))):
        return "names a path twice, or a file as a folder"
    return ""


def _parts(name: str) -> tuple[str, ...] | None:
    """A member's name as its parts (`.` parts dropped, one trailing `/` allowed), or None where it is
    absolute or holds `..` or an empty part (`a//b`)."""
    parts = [part for part in name.removesuffix("/").split("/") if part != "."]
    if name.startswith("/") or any(part in ("", "..") for part in parts):
        return None
    return tuple(parts)


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symbolic link (to {member.linkname!r})"
    if member.islnk():
        return f"a hard link (to {member.linkname!r})"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a FIFO"
    return f"of tar type {member.type!r}"


def _write_members(tar: tarfile.TarFile, members: list[tuple[tarfile.TarInfo, tuple[str, ...]]], into: Path) -> None:
    """The checked members' folders made and files written under `into`, a folder this process made
    (no link in it: none is written), each file created new, never through a link."""
    for member, parts in members:
        if member.isdir():
            _folders(into, parts)
            continue
        mode = 0o755 if member.mode & 0o100 else 0o644
        fd = os.open(_folders(into, parts[:-1]) / parts[-1], NEW, mode)
        with open(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # readable by every user of the node, whatever this umask
            source = tar.extractfile(member)
            assert source is not None  # (a regular file's)
            shutil.copyfileobj(source, f)


def _folders(into: Path, parts: tuple[str, ...]) -> Path:
    """`into/<parts...>`, each folder made (0755) where absent."""
    path = into
    for part in parts:
        path = path / part
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        os.chmod(path, 0o755)  # nosec B103 # compiled folders: every user of the node reads them, none writes
    return path
