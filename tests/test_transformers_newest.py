"""The transformers, diffusers and quantization tests again, on the newest transformers release the
project declares (`integrations/transformers_internals.py`'s HIGHEST), beside the one vLLM pins: the
README's test command installs it apart (`.venv/transformers-newest`, no dependencies: the suite's own
serve it), and these tests run in a child process that imports it first. Both ends of the declared
range are tested in every run.

The child, a pytest run of its own, starts beside the suite when its collection ends (`tests/beside.py`);
the test, among the last, reads what it left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import beside as children

ROOT = Path(__file__).resolve().parent.parent
NEWEST = ROOT / ".venv" / "transformers-newest"  # pip install --no-deps --target (the README's test command)
FILES = ["tests/test_transformers.py", "tests/test_quantization.py", "tests/test_fp8_scales.py",
         "tests/test_diffusers.py", "tests/test_store_trust.py"]  # fmt: skip
JOB = "transformers-newest"
TIMEOUT = 1200  # s, from the child's start
ABSENT = f"{NEWEST} is absent: the README's test command installs the newest transformers there"


def _version(env: dict[str, str]) -> str:
    code = "import transformers; print(transformers.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()  # fmt: skip


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(NEWEST), str(ROOT)])}


@children.job(JOB, __name__)
def _start(folder: Path) -> subprocess.Popen[bytes] | str:
    """The child pytest over `FILES`."""
    if not NEWEST.is_dir():
        return ABSENT
    # its own temporary root: pytest removes all but the newest 3 of the shared one's, this run's among them
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={folder / 'child'}", *FILES]
    with (folder / "stdout").open("wb") as out, (folder / "stderr").open("wb") as err:
        return subprocess.Popen(argv, cwd=ROOT, env=_environment(), stdout=out, stderr=err, start_new_session=True)


@pytest.mark.usefixtures("beside")
def test_the_transformers_tests_pass_on_the_newest_release() -> None:
    from streamload.integrations.transformers_internals import HIGHEST

    if not NEWEST.is_dir():
        pytest.skip(ABSENT)
    got = _version(_environment())  # (while the child runs)
    assert tuple(int(p) for p in got.split(".")[:2]) == HIGHEST, f"{NEWEST} holds transformers {got}"
    assert got != _version(dict(os.environ)), "the child would run the suite's own transformers"
    run = children.finished(JOB, TIMEOUT)
    assert run.folder is not None and run.process is not None
    stdout = (run.folder / "stdout").read_text(errors="replace")
    stderr = (run.folder / "stderr").read_text(errors="replace")
    status = f"killed after {TIMEOUT} s" if run.timed_out else f"exit {run.process.returncode}"
    assert run.process.returncode == 0, f"on transformers {got} ({status}):\n{stdout[-6000:]}{stderr[-2000:]}"
    assert " passed" in stdout.splitlines()[-1], stdout[-2000:]
