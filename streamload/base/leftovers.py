"""Working directories owned by a process, which the next start removes once their owner is gone.

A process ended by SIGKILL, the OOM killer or a crash-looping pod runs no exit handler: its staging
(a whole checkpoint fetched from object storage, an archive being unpacked) would stay on disk for
good. So each such directory holds a record of its owner (`.owner.json`: process id, the process's
start time, the host's name, its boot and the pid namespace; and any process it `share`s the
directory with, such as the fetch it started), and `sweep` removes those whose owners have all
ended: a process of that id that started at another time is another process (ids are reused), and
after a reboot no owner lives.

Only this host's directories are judged. The folder may be shared by hosts (a home over NFS holding
`VLLM_CACHE_ROOT`, as on most Slurm clusters, where every node of a multi-node engine unpacks at
once): a record of another host is left alone, its owner cannot be seen from here; a record of this
host under another boot id is a reboot's leftover. A record without a host (an older release) is
judged as ever where its boot is this machine's; under another boot it may be another host's as well
as a reboot's, so it is left alone unless untouched for `_FOREIGN_AGE` (a week: a staging lives from
an engine's start to its load's end, an unpack seconds). Hosts are told apart by name: two machines
of one name sharing a folder look like one that rebooted. Directories of a pid namespace other than
the sweeper's (another container on this host) are left alone too: their owner cannot be seen. Where
processes cannot be seen at all (no /proc), nothing is removed.

Nothing is removed through a link: a candidate is judged on its own `lstat` (a link is skipped), and
`shutil.rmtree` walks by file descriptors where the platform allows (`rmtree.avoids_symlink_attacks`,
true on Linux): each directory is opened without following links and checked to be the one `lstat`
saw, so a link swapped in for a directory, the candidate included, is not followed (where that
protection is missing, nothing is removed). No torch here: the fetch started before vLLM's import
sweeps too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
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
    record["also"] = [*record.get("also", []), {"pid": pid, "start": _started(pid)}]
    atomic.write(path / RECORD, json.dumps(record).encode())


def remove(path: Path, pid: int) -> bool:
    """Remove `path`, a directory `make` recorded for process `pid` of this host and boot (a process
    that has ended without removing it: the caller knows), and nothing else: a link, another user's
    directory or one recorded for another process is left alone. Whether it is gone."""
    try:
        st = path.lstat()
        owner = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return False
    me = _me()
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or not isinstance(owner, dict):
        return False
    if (owner.get("pid"), owner.get("host"), owner.get("boot")) != (pid, me["host"], me["boot"]):
        return False
    for _ in range(3):  # a thread of the caller's may still be writing there: what it adds is removed again
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return True
    return False


def sweep(prefix: str, parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's directories `parent/<prefix>*` whose owner has ended; those removed."""
    folder = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    try:
        candidates = [p for p in folder.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    removed, me = [], _me()
    if me["start"] is None or not shutil.rmtree.avoids_symlink_attacks:
        return []  # no owner can be seen (no /proc), or removing could follow a link swapped in
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
    if not isinstance(owner, dict) or not _of_this_host(owner, path, mtime, me):
        return False
    if owner.get("boot") != me["boot"]:
        return True  # rebooted since: no process of that boot lives
    if owner.get("pid_ns") != me["pid_ns"]:
        return False  # another container's: its owner is not visible from here
    owners = [owner, *(o for o in owner.get("also", []) if isinstance(o, dict))]
    return all(_started(int(o.get("pid", 0))) != o.get("start") for o in owners)


def _of_this_host(owner: dict[str, object], path: Path, mtime: float, me: dict[str, object]) -> bool:
    """Whether `owner` (a record) is to be judged here: this host's, or hostless (an older release's)
    and of this boot, or hostless and so old that whoever made it is done with it (module docstring)."""
    if "host" in owner:
        return owner["host"] == me["host"]
    if owner.get("boot") == me["boot"]:
        return True
    try:
        touched = max(mtime, (path / RECORD).lstat().st_mtime)  # `share` rewrites the record
    except OSError:
        return False
    return time.time() - touched > _FOREIGN_AGE


def _me() -> dict[str, object]:
    pid = os.getpid()
    return {"pid": pid, "start": _started(pid), "host": socket.gethostname(), "boot": _boot(), "pid_ns": _pid_ns()}


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
