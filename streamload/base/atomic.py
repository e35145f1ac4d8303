"""Files and folders put in place whole, by a rename: a reader sees each whole or not at all.

`write` writes a file under a name of the writer's own beside it (`<name>.partial.<host>.<pid>.<random>`:
created new, never through a symlink, so that two writers never mix their bytes) and renames it into
place (or links it, where an existing file is never replaced); `folder` opens a folder under a root
without following links, for `write`'s `dir_fd`. What fails leaves nothing of it behind. No torch here:
the fetch started before vLLM's import writes too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PARTIAL = ".partial."  # a file being written: `<name>.partial.<writer_tag()>`
NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a file of this writer's own
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
    """`data` (bytes, or a function that writes them into the file it is given) put at `target` whole:
    written into a new file `temporary` (default: a name of this writer's own beside `target`), flushed
    to disk where `sync`, then renamed over `target` (`dir_fd`: a `folder`, `target` a name in it).
    `replace=False`: put in place only where `target` is absent, also where another writer puts one
    there meanwhile (a link, not a rename): False where it was there. Raises what fails, with the
    temporary file removed."""
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
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
    with contextlib.suppress(FileExistsError):  # made meanwhile (by another process), or a link: opened as any other
        os.mkdir(name, 0o777, dir_fd=parent)
    return os.open(name, FOLDER, dir_fd=parent)
