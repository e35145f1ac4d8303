"""Archives unpacked as data where they are installed (compiled.py's `install`): `unpack` writes an
archive's files and folders one by one (never `extractall`: no links, devices, or names leaving the
folder) into a folder of this process's own inside a root (`streamload/base/leftovers.py`) and renames into
place what the root lacks. What fails leaves nothing of it behind."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path

from streamload.base import atomic, leftovers

INSTALLING = ".streamload-installing-"  # an archive being unpacked into a root (base/leftovers.py)


def unpack(data: bytes, root: Path, pick: Callable[[Path], Iterable[Path]], what: str = "an archive") -> list[Path]:
    """Write the tar archive `data` (uncompressed) into a folder of this process's own inside `root`
    (what an unpack killed midway left is removed first), then rename each path `pick` names in that
    folder to the same place in `root`, where `root` lacks it, each whole; the paths put in place. Only
    files (0644, or 0755 where executable) and folders (0755) are written; an archive (`what`, in the
    error) holding anything else, or a name that is not plain, is refused whole (ValueError) before a
    byte of it is written: it is not what `publish` packs."""
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # uncompressed only: no gzip bomb
        members = _checked(tar.getmembers(), what)
    except tarfile.TarError as exc:
        raise ValueError(f"{what}: not an uncompressed tar archive ({exc}); nothing of it was installed") from None
    root.mkdir(parents=True, exist_ok=True)
    leftovers.sweep(INSTALLING, root)
    staging = leftovers.make(INSTALLING, root)
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
    """Whether `staged` moved to `root/<parts...>`, where that was absent, each folder on the way opened
    without following a link: a link planted there by another user of a shared root makes nothing move."""
    try:
        into = atomic.folder(root, *parts[:-1])
    except (OSError, ValueError):
        return False
    try:
        try:
            os.stat(parts[-1], dir_fd=into, follow_symlinks=False)
            return False  # there already
        except FileNotFoundError:
            os.rename(staged, parts[-1], dst_dir_fd=into)
            return True
    except OSError:  # unreadable, or another process put it there first
        return False
    finally:
        os.close(into)


def _checked(members: list[tarfile.TarInfo], what: str) -> list[tuple[tarfile.TarInfo, tuple[str, ...]]]:
    """Each member with its name's parts, where all are files and folders under plain relative names,
    none named twice nor both a file and a folder; else ValueError naming `what` and the member."""
    out: list[tuple[tarfile.TarInfo, tuple[str, ...]]] = []
    files: set[tuple[str, ...]] = set()
    folders: set[tuple[str, ...]] = set()
    for member in members:
        parts = _parts(member.name)
        if refused := _refusal(member, parts, files, folders):
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
    if member.issym() or member.islnk():
        return f"a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r})"
    if member.ischr() or member.isblk():
        return "a device"
    return "a FIFO" if member.isfifo() else f"of tar type {member.type!r}"


def _write_members(tar: tarfile.TarFile, members: list[tuple[tarfile.TarInfo, tuple[str, ...]]], into: Path) -> None:
    """The checked members' folders made and files written under `into`, a folder this process made
    (no link in it: none is written), each file created new, never through a link."""
    for member, parts in members:
        if member.isdir():
            _folders(into, parts)
            continue
        mode = 0o755 if member.mode & 0o100 else 0o644
        fd = os.open(_folders(into, parts[:-1]) / parts[-1], atomic.NEW, mode)
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
