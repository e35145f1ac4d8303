"""The `streamload` command as a user runs it: in a process of its own, from the repository's root; what a
failed run prints (status 1, one `streamload: error:` line naming what was wrong, no traceback); and a small
checkpoint to run it on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streamload.commands.demo import Shape, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real command, in its own process (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "streamload", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)  # fmt: skip


def one_line_error(run: subprocess.CompletedProcess[str], *named: str) -> str:
    """The run failed with status 1 and one `streamload: error:` line naming each of `named`, no traceback."""
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("streamload: error:")]
    assert len(errors) == 1, run.stderr
    for text in named:
        assert text in errors[0], errors[0]
    return errors[0]


def small_checkpoint(folder: Path) -> Path:
    """A two-shard llama-named checkpoint (with its index) of a few kilobytes, in `folder`."""
    write_checkpoint(folder, Shape(vocab=64, hidden=32, intermediate=48, layers=2), shards=2)
    return folder
