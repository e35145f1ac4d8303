"""Checks that run whole in a child process of their own (the transformers tests on the newest release, a
TP=2 vLLM engine's failed reload) start beside the suite when its collection ends, as the vLLM engines do
(conftest.py), and the tests that read them run last: the suite's own tests run meanwhile.

A test module registers its child with `@job(name, __name__)`: a function given an empty folder of the
job's own that starts the child (`subprocess.Popen`, in a session of its own) or says why it cannot run.
Its test reads it through `finished(name, timeout)`, which starts it then if nothing did (the module run
without the suite's hooks).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

# The engines and these children yield the cores to the suite's own tests, which wait for them only at the
# end: on 2 cores the engines took most of both from the tests (each ~3x slower), and the whole run waited
# for those tests while the engines ended minutes before it.
NICE = 10
Start = Callable[[Path], "subprocess.Popen[bytes] | str"]  # the child started in the folder, or why it cannot run


@dataclass
class Job:
    """One child: its start, and once started, its folder, its process (or why none) and when it began."""

    name: str
    module: str  # the test module whose tests read it
    start: Start
    started: bool = False
    folder: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    skipped: str = ""  # why no child runs here
    error: str = ""  # where starting it raised
    began: float = 0.0
    timed_out: bool = False


JOBS: dict[str, Job] = {}


def yield_cores(pid: int) -> None:
    """The process `pid`, just started in a session of its own, and all it starts, run at `NICE`. Where the
    kernel groups processes by session for its scheduler (autogroup), each session is weighed as one
    against the others, whatever its processes' nice: that group's own nice is set too."""
    os.setpriority(os.PRIO_PROCESS, pid, NICE)  # inherited by what it starts (it has started nothing yet)
    try:
        Path(f"/proc/{pid}/autogroup").write_text(f"{NICE}\n")
    except OSError:  # no autogroup in this kernel (or the process already ended): its nice is what counts
        pass


def job(name: str, module: str) -> Callable[[Start], Start]:
    """Registers `start` as the job `name`, read by the tests of `module`."""

    def register(start: Start) -> Start:
        JOBS[name] = Job(name, module, start)
        return start

    return register


def begin(modules: Iterable[str]) -> None:
    """Starts the jobs read by tests of `modules` (those collected)."""
    chosen = set(modules)
    for j in JOBS.values():
        if j.module in chosen:
            launch(j)


def launch(j: Job) -> None:
    """`j` started, once (a second call does nothing)."""
    if j.started:
        return
    j.started, j.began = True, time.monotonic()
    try:
        j.folder = Path(tempfile.mkdtemp(prefix=f"streamload-{j.name}-"))
        got = j.start(j.folder)
    except Exception:  # the test that reads it fails with it
        j.error = f"the child {j.name!r} did not start:\n{traceback.format_exc()}"
        return
    if isinstance(got, str):
        j.skipped = got
    else:
        j.process = got
        yield_cores(got.pid)


def finished(name: str, timeout: float) -> Job:
    """The job `name` once its child ended, or was killed `timeout` seconds after it started (its
    `process.returncode` then the kill's, `timed_out` set): started here where nothing started it. The
    test skips where the child cannot run here, and fails where starting it raised."""
    j = JOBS[name]
    launch(j)
    if j.error:
        pytest.fail(j.error, pytrace=False)
    if j.process is None:
        pytest.skip(j.skipped)
    try:
        j.process.wait(timeout=max(1.0, timeout - (time.monotonic() - j.began)))
    except subprocess.TimeoutExpired:
        j.timed_out = True
        kill(j)
    return j


def kill(j: Job) -> None:
    """`j`'s child and everything it started (its session's process group) ended."""
    if j.process is None:
        return
    try:
        os.killpg(j.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    j.process.wait()


def end(j: Job) -> None:
    """`j`'s child ended (killed where it still runs) and its folder removed."""
    kill(j)
    if j.folder is not None:
        shutil.rmtree(j.folder, ignore_errors=True)


def end_all() -> None:
    """Every job ended: the session's end."""
    for j in JOBS.values():
        end(j)
