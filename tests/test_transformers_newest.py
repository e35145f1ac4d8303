"""The transformers, diffusers and quantization tests again, on the newest transformers release the
project declares (`integrations/transformers_internals.py`'s HIGHEST), beside the one vLLM pins: the
README's test command installs it apart (`.venv/transformers-newest`, no dependencies: the suite's own
serve it), and these tests run in a child process that imports it first. Both ends of the declared
range are tested in every run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEWEST = ROOT / ".venv" / "transformers-newest"  # pip install --no-deps --target (the README's test command)
FILES = ["tests/test_transformers.py", "tests/test_quantization.py", "tests/test_fp8_scales.py",
         "tests/test_diffusers.py", "tests/test_store_trust.py"]  # fmt: skip


def _version(env: dict[str, str]) -> str:
    code = "import transformers; print(transformers.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()  # fmt: skip


def test_the_transformers_tests_pass_on_the_newest_release(tmp_path: Path) -> None:
    if not NEWEST.is_dir():
        pytest.skip(f"{NEWEST} is absent: the README's test command installs the newest transformers there")
    from streamload.integrations.transformers_internals import HIGHEST

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(NEWEST), str(ROOT)])}
    got = _version(env)
    assert tuple(int(p) for p in got.split(".")[:2]) == HIGHEST, f"{NEWEST} holds transformers {got}"
    assert got != _version(dict(os.environ)), "the child would run the suite's own transformers"
    # its own temporary root: pytest removes all but the newest 3 of the shared one's, this run's among them
    basetemp = f"--basetemp={tmp_path / 'child'}"
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", basetemp, *FILES], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert ran.returncode == 0, f"on transformers {got}:\n{ran.stdout[-6000:]}{ran.stderr[-2000:]}"
    assert " passed" in ran.stdout.splitlines()[-1], ran.stdout[-2000:]
