"""`tests/beside.py`, the children run beside the suite: a child that cannot run here skips its test, one
whose start raised fails it, one past its time is killed with all it started, and every one yields the
cores to the suite's own tests (its nice, and its session's where the kernel schedules sessions apart)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import beside as children

# Starts a grandchild (in its process group) that sleeps, says the grandchild's pid, and sleeps.
SLEEPER = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"


def _ends(pid: int, within: float = 10.0) -> bool:
    """Whether the process `pid` is gone or a zombie within `within` seconds (a killed process is still
    running for a moment, as it exits)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _register(monkeypatch: pytest.MonkeyPatch, name: str, start: children.Start) -> None:
    monkeypatch.setitem(children.JOBS, name, children.Job(name, __name__, start))


def test_a_child_that_cannot_run_here_skips_and_one_whose_start_raised_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(folder: Path) -> subprocess.Popen[bytes]:
        raise RuntimeError(f"nothing in {folder.name}")

    _register(monkeypatch, "absent", lambda folder: "the tool is absent")
    _register(monkeypatch, "broken", broken)
    with pytest.raises(pytest.skip.Exception, match="the tool is absent"):
        children.finished("absent", 10)
    with pytest.raises(pytest.fail.Exception, match="RuntimeError: nothing in streamload-broken-"):
        children.finished("broken", 10)
    for name in ("absent", "broken"):
        folder = children.JOBS[name].folder
        children.end(children.JOBS[name])
        assert folder is not None and not folder.exists()


def test_a_child_past_its_time_is_killed_with_what_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(folder: Path) -> subprocess.Popen[bytes]:
        with (folder / "out").open("wb") as out:
            return subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=out, start_new_session=True)

    _register(monkeypatch, "sleeper", start)
    children.begin([__name__])  # as the suite's collection starts it
    run = children.JOBS["sleeper"]
    assert run.process is not None and run.folder is not None
    deadline = time.monotonic() + 60
    while not (run.folder / "out").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int((run.folder / "out").read_text())
    nice = os.getpriority(os.PRIO_PROCESS, run.process.pid)
    group = Path(f"/proc/{run.process.pid}/autogroup")
    grouped = group.read_text() if group.exists() else ""
    assert children.finished("sleeper", 1) is run and run.timed_out and run.process.returncode == -9
    assert _ends(grandchild), f"the grandchild {grandchild} still runs"
    assert nice == children.NICE  # and the grandchild was started at it
    assert not grouped or grouped.strip().endswith(f"nice {children.NICE}"), grouped
    children.end(run)
    assert not run.folder.exists()
