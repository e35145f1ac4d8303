"""The security linter over the package: no finding, or an exemption explained on its line
(`# nosec <id> # why`; the one skipped everywhere is explained in pyproject.toml's [tool.bandit])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bandit_finds_nothing_in_the_package() -> None:
    found = subprocess.run(
        [sys.executable, "-m", "bandit", "-q", "-c", "pyproject.toml", "-r", "streamload", "-f", "custom",
         "--msg-template", "{relpath}:{line}: {test_id} {msg}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert found.returncode == 0, f"bandit:\n{found.stdout}{found.stderr}"


def test_every_exemption_says_why() -> None:
    """A `# nosec` names the finding it exempts and says why, after a second `#`."""
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "streamload").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "# nosec" in line and not _explained(line.split("# nosec", 1)[1])
    ]
    assert not bare, f"exemptions without a finding's id and a reason: {bare}"


def _explained(rest: str) -> bool:
    ids, _, why = rest.partition("#")
    return ids.strip().startswith("B") and len(why.strip()) >= 5
