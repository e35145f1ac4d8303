"""Working directories owned by a process, which the next start removes once their owner is gone.

A process ended by SIGKILL, the OOM killer or a crash-looping pod runs no exit handler: its staging
(a whole checkpoint fetched from object storage, an archive being unpacked) would stay on disk for
good. So each such directory holds a record of its owner (`.owner.json`: process id, the process's
start time, the boot and the pid namespace; and any process it `share`s the directory with, such as
the fetch it started), and `sweep` removes those whose owners have all ended: a
process of that id that started at another time is another process (ids are reused), and after a
reboot no owner lives. Directories of a pid namespace other than the sweeper's (another container
sharing the folder) are left alone: their owner cannot be seen from here. No torch here: the fetch
started before vLLM's import sweeps too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from . import atomic

RECORD = ".owner.json"
_UNRECORDED_GRACE = 60.0  # s: a directory made but not yet recorded (or by an older release) is young

log = logging.getLogger("streamload")


def make(prefix: str, parent: str | os.PathLike[str] | None = None) -> Path:
    """A new directory `parent/<prefix><random>` (default: the temporary directory) recording this
    process as its owner."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        atomic.write(path / RECORD, json.dumps(_me()).encode())
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def share(path: Path, pid: int) -> None:
    """Process `pid` (a child writing there too) owns `path` as well: it is kept while either runs."""
    record = json.loads((path / RECORD).read_text())
    record["also"] = [*record.get("also", []), {"pid": pid, "start": _started(pid)}]
    atomic.write(path / RECORD, json.dumps(record).encode())


def sweep(prefix: str, parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's directories `parent/<prefix>*` whose owner has ended; those removed."""
    folder = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    try:
        candidates = [p for p in folder.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    removed, me = [], _me()
    for path in candidates:
        try:
            st = path.lstat()  # a link is not followed (nor removed through)
        except OSError:
            continue
        if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid():
            continue
        if _owner_gone(path, st.st_mtime, me):
            size = _size(path)
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
                log.info("streamload: removed %s (%.1f MB), left by a process that has ended", path, size / 1e6)
    return removed


def _owner_gone(path: Path, mtime: float, me: dict[str, object]) -> bool:
    try:
        owner = json.loads((path / RECORD).read_text())
    except FileNotFoundError:
        return time.time() - mtime > _UNRECORDED_GRACE
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict):
        return False
    if owner.get("boot") != me["boot"]:
        return True  # rebooted since: no process of that boot lives
    if owner.get("pid_ns") != me["pid_ns"]:
        return False  # another container's: its owner is not visible from here
    owners = [owner, *(o for o in owner.get("also", []) if isinstance(o, dict))]
    return all(_started(int(o.get("pid", 0))) != o.get("start") for o in owners)


def _me() -> dict[str, object]:
    return {"pid": os.getpid(), "start": _started(os.getpid()), "boot": _boot(), "pid_ns": _pid_ns()}


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), or None: no such process, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])  # field 22 of stat: after the name, the 20th


def _boot() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
