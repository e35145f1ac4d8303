"""Files and folders put in place whole, by a rename: a reader sees each whole or not at all.

`write` writes a file under a name of the writer's own beside it (`<name>.partial.<host>.<pid>.<random>`:
created new, never through a symlink, so that two writers never mix their bytes) and renames it into
place; `unpack` unpacks an archive into a folder of this process's own inside a root (`owned.py`) and
renames into place what the root lacks. What fails leaves nothing of it behind. No torch here: the
fetch started before vLLM's import writes and unpacks too.
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

PARTIAL = ".partial."  # a file being written: `<name>.partial.<writer_tag()>`
NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a file of this writer's own
INSTALLING = ".streamload-installing-"  # an archive being unpacked into a root (owned.py)


def writer_tag() -> str:
    """This writer's part of a partial file's name: host, process id, and a random part."""
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def write(
    target: Path, data: bytes | Callable[[BinaryIO], object], sync: bool = False, temporary: Path | None = None
) -> None:
    """`data` put at `target` whole: written into a new file `temporary` (default: a name of this
    writer's own beside `target`), flushed to disk where `sync`, then renamed over `target`. `data` is
    the bytes, or a function that writes them into the file object it is given (an archive). Raises
    what fails (an OSError: a full disk), with the temporary file removed."""
    tmp = target.with_name(f"{target.name}{PARTIAL}{writer_tag()}") if temporary is None else temporary
    fd = os.open(tmp, NEW, 0o666)
    try:
        with open(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unpack(data: bytes, root: Path, pick: Callable[[Path], Iterable[Path]]) -> list[Path]:
    """Unpack the tar archive `data` into a folder of this process's own inside `root` (what an unpack
    killed midway left is removed first), then rename each path `pick` names in that folder (it is
    given the folder) to the same place in `root`, where `root` lacks it: each whole, or not at all
    (another process may have put it there first). The paths put in place; the rest is removed."""
    import tarfile  # only where an archive is unpacked: the fetch process starts in milliseconds

    from . import owned  # (owned.py writes its records through `write`)

    root.mkdir(parents=True, exist_ok=True)
    owned.sweep(INSTALLING, root)
    staging = owned.make(INSTALLING, root)
    added: list[Path] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(staging, filter="data")  # no absolute paths, links out or devices
        for staged in pick(staging):
            dest = root / staged.relative_to(staging)
            if dest.exists():
                continue  # the root's own: never replaced
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staged, dest)
                added.append(dest)
            except OSError:
                pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return added
