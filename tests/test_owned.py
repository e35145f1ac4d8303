"""Working directories and their owners (`base/leftovers.py`) where a folder is shared by hosts (a home over NFS,
as on most Slurm clusters): only this host's leftovers are removed, another host's are left to it; and
the fetch of an engine killed without its exit handlers removes the folder it was writing in."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from streamload.base import leftovers as owned
from streamload.integrations.startup import prefetch

from .conftest import write_raw
from .servers import RangeServer

PREFIX = "streamload-test-owned-"


def _recorded(parent: Path, **changes: object) -> Path:
    """A directory this process owns, its record changed by `changes` (a key set to None: dropped)."""
    path = owned.make(PREFIX, parent)
    record = {**json.loads((path / owned.RECORD).read_text()), **changes}
    (path / owned.RECORD).write_text(json.dumps({k: v for k, v in record.items() if v is not None}))
    return path


def _made_by_a_process_that_ended(parent: Path) -> Path:
    code = "import sys; from streamload.base import leftovers as owned; print(owned.make(sys.argv[1], sys.argv[2]))"
    said = subprocess.run([sys.executable, "-c", code, PREFIX, str(parent)], capture_output=True, text=True, check=True)
    return Path(said.stdout.strip())


def test_another_hosts_directories_are_left_to_it(tmp_path: Path) -> None:
    """Two hosts over one folder: a record of another host is never judged here (its process ids and
    boot are not this machine's); this host's are, a reboot's leftover included."""
    other_host = _recorded(tmp_path, host="node-2.cluster", boot=str(uuid.uuid4()))  # live-looking there
    other_host_ended = _recorded(tmp_path, host="node-2.cluster", pid=1 << 30, start=1)
    rebooted = _recorded(tmp_path, boot=str(uuid.uuid4()))  # this host, another boot: its owner is gone
    ended = _made_by_a_process_that_ended(tmp_path)  # this host and boot, a process that has ended
    mine = owned.make(PREFIX, tmp_path)  # this process's: it runs
    assert sorted(owned.sweep(PREFIX, tmp_path)) == sorted([rebooted, ended])
    assert other_host.is_dir() and other_host_ended.is_dir() and mine.is_dir()
    assert json.loads((mine / owned.RECORD).read_text())["host"] == socket.gethostname()


def test_a_record_of_an_older_release_without_a_host(tmp_path: Path) -> None:
    """A hostless record of this boot is judged as ever; of another boot it may be another host's:
    left alone unless untouched for a week."""
    ended = _made_by_a_process_that_ended(tmp_path)
    record = json.loads((ended / owned.RECORD).read_text())
    record.pop("host", None)
    (ended / owned.RECORD).write_text(json.dumps(record))
    running_hostless = _recorded(tmp_path, host=None)
    another_boot = _recorded(tmp_path, host=None, boot=str(uuid.uuid4()))
    another_boot_old = _recorded(tmp_path, host=None, boot=str(uuid.uuid4()))
    week_ago = time.time() - 8 * 24 * 3600
    for path in (another_boot_old / owned.RECORD, another_boot_old):
        os.utime(path, (week_ago, week_ago))
    assert sorted(owned.sweep(PREFIX, tmp_path)) == sorted([ended, another_boot_old])
    assert running_hostless.is_dir() and another_boot.is_dir()


def _another_host_can_run() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _another_host_can_run(), reason="`unshare --uts` (a host name of its own) is not allowed here")
def test_a_process_under_another_host_name_keeps_its_directory(tmp_path: Path) -> None:
    """A real second "host": a process in a UTS namespace of its own, named otherwise, makes its
    directory; this host's sweep leaves it alone while it runs and after it has ended (its host judges it)."""
    code = (
        "import socket, sys; socket.sethostname('streamload-node-2'); from streamload.base import leftovers as owned; "
        "print(owned.make(sys.argv[1], sys.argv[2]), flush=True); sys.stdin.read()"
    )
    other = subprocess.Popen(["unshare", "--uts", sys.executable, "-c", code, PREFIX, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert other.stdout is not None and other.stdin is not None
        made = Path(other.stdout.readline().strip())
        record = json.loads((made / owned.RECORD).read_text())
        assert owned.sweep(PREFIX, tmp_path) == [] and made.is_dir()
        other.stdin.close()
        assert other.wait(30) == 0
        assert owned.sweep(PREFIX, tmp_path) == [] and made.is_dir()
        assert record.get("host") == "streamload-node-2"
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(10)


def test_remove_removes_only_a_directory_recorded_for_that_process(tmp_path: Path) -> None:
    mine = owned.make(PREFIX, tmp_path)
    link = tmp_path / f"{PREFIX}link"
    link.symlink_to(mine, target_is_directory=True)
    assert not owned.remove(mine, os.getppid()) and mine.is_dir()  # recorded for another process
    assert not owned.remove(link, os.getpid()) and link.is_symlink() and mine.is_dir()  # never through a link
    other_host = _recorded(tmp_path, host="node-2.cluster")
    assert not owned.remove(other_host, os.getpid()) and other_host.is_dir()
    assert owned.remove(mine, os.getpid()) and not mine.exists()


def _ended(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while prefetch._alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not prefetch._alive(pid)


def test_the_fetch_of_a_killed_engine_removes_its_staging(tmp_path: Path) -> None:
    """Engines SIGKILLed mid-download run no exit handler; the fetch each started sees its engine gone
    and ends, removing the staging directory it was writing in (a user's cache directory is kept)."""
    (tmp_path / "store" / "m").mkdir(parents=True)
    write_raw(tmp_path / "store" / "m" / "model.safetensors", {"w": ("F32", [3 << 18], bytes(3 << 20))})
    server = RangeServer(tmp_path / "store")
    server.faults = ["stall:60"] * 64  # downloads hang: the engines die mid-way
    temp, cache = tmp_path / "tmp", tmp_path / "cache"
    temp.mkdir()
    code = (
        "import sys; from streamload.integrations.startup import prefetch; "
        "s = prefetch.ahead(sys.argv[1], *sys.argv[2:]); print(s['pid'], s['done'], flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "TMPDIR": str(temp)}
    env.pop(prefetch.ENV, None)
    url = f"{server.url}/m/"
    engines = [subprocess.Popen([sys.executable, "-c", code, url, *extra], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for extra in ([], [str(cache)])]  # fmt: skip
    try:
        said = [engine.stdout.readline().split() for engine in engines if engine.stdout is not None]
        works = [Path(done).parent for _, done in said]
        assert len(works) == 2 and all(w.is_dir() and w.parent == temp for w in works)
        deadline = time.monotonic() + 30
        while server.data_requests() == 0 and time.monotonic() < deadline:  # downloading
            time.sleep(0.05)
    finally:
        for engine in engines:
            engine.send_signal(signal.SIGKILL)  # no exit handler runs
            engine.wait(10)
    try:
        assert all(_ended(int(fetch)) for fetch, _ in said)
        assert [p.name for p in temp.iterdir() if p.name.startswith(prefetch.STAGING)] == []
        assert cache.is_dir()  # the user's cache directory: what was fetched there is kept
    finally:
        server.close()
