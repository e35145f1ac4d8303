"""Working directories owned by a process, which the next start removes once their owners are gone.

A process ended by SIGKILL, the OOM killer or a crash-looping pod runs no exit handler: its staging
(a whole checkpoint, an archive being unpacked) would stay on disk for good. So each such directory
records its owners (`.owner.json`: process id and start time, host, boot id, pid namespace; and any
process it is `share`d with), and `sweep` removes those whose owners have all ended: an id that
started at another time is another process (ids are reused), and after a reboot no owner lives.

Only this host's directories are judged: a folder may be shared by hosts (a home over NFS holding
`VLLM_CACHE_ROOT`, as on most Slurm clusters), and another host's, another pid namespace's (another
container's) owners cannot be seen from here; without /proc nothing is removed. A record without a
host (an older release) of another boot may be another host's, so it waits for `_FOREIGN_AGE` (a
staging lives from an engine's start to its load's end). Hosts are told apart by name.

Nothing is removed through a link: a candidate is judged on its own `lstat`, and `shutil.rmtree`
walks by descriptors (where it cannot, `rmtree.avoids_symlink_attacks`, nothing is removed), so a
link swapped in for a directory is not followed. No torch here: the fetch started before vLLM sweeps too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from streamload.base import atomic

RECORD = ".owner.json"
_UNRECORDED_GRACE = 60.0  # s: a directory made but not yet recorded (or by an older release) is young
_FOREIGN_AGE = 7 * 24 * 3600.0  # s: a record without a host, of another boot, untouched this long is a leftover

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
    record["also"] = [*record.get("also", []), {"pid": pid, "start": started(pid)}]
    atomic.write(path / RECORD, json.dumps(record).encode())


def remove(path: Path, pid: int) -> bool:
    """Remove `path`, a directory `make` recorded for process `pid` of this host and boot (a process
    that has ended without removing it: the caller knows), and nothing else: a link, another user's
    directory or one recorded for another process is left alone. Whether it is gone."""
    try:
        owner = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return False
    if _mine(path) is None or not isinstance(owner, dict):
        return False
    me = _me()
    return (owner.get("pid"), owner.get("host"), owner.get("boot")) == (pid, me["host"], me["boot"]) and _removed(path)


def sweep(prefix: str, parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's directories `parent/<prefix>*` whose owners have ended; those removed."""
    me = _me()
    if me["start"] is None or not shutil.rmtree.avoids_symlink_attacks:
        return []  # no owner can be seen (no /proc), or removing could follow a link swapped in
    folder = Path(tempfile.gettempdir() if parent is None else parent)
    try:
        candidates = [p for p in folder.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for path in candidates:
        st = _mine(path)
        if st is not None and _owner_gone(path, st.st_mtime, me):
            size = _size(path)
            if _removed(path):
                removed.append(path)
                log.info("streamload: removed %s (%.1f MB), left by a process that has ended", path, size / 1e6)
    return removed


def _mine(path: Path) -> os.stat_result | None:
    """`path`'s own status where it is a directory of this user's (`lstat`: a link is none)."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None


def _removed(path: Path) -> bool:
    for _ in range(3):  # a thread of the caller's may still be writing there: what it adds is removed again
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return True
    return False


def _owner_gone(path: Path, mtime: float, me: dict[str, object]) -> bool:
    try:
        owner = json.loads((path / RECORD).read_text())
    except FileNotFoundError:
        return time.time() - mtime > _UNRECORDED_GRACE
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("host", me["host"]) != me["host"]:
        return False  # another host's: its owner is not visible from here
    if owner.get("boot") != me["boot"]:
        if "host" in owner:
            return True  # rebooted since: no process of that boot lives
        try:  # hostless (an older release's), perhaps another host's: judged by age (`share` rewrites the record)
            return time.time() - max(mtime, (path / RECORD).lstat().st_mtime) > _FOREIGN_AGE
        except OSError:
            return False
    if owner.get("pid_ns") != me["pid_ns"]:
        return False  # another container's: its owner is not visible from here
    owners = [owner, *(o for o in owner.get("also", []) if isinstance(o, dict))]
    return all(started(int(o.get("pid", 0))) != o.get("start") for o in owners)


def _me() -> dict[str, object]:
    pid, boot, pid_ns = os.getpid(), "", ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        pid_ns = os.readlink("/proc/self/ns/pid")
    return {"pid": pid, "start": started(pid), "host": socket.gethostname(), "boot": boot, "pid_ns": pid_ns}


def started(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), or None: no such process, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])  # field 22 of stat: after the name, the 20th


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total
