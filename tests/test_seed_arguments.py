"""A seeder's arguments (servers/seed.py `Seeder`, `serve`): a cache directory it could never serve from, or
a port no socket has, refused at construction in one line naming it; nothing is left listening."""

from __future__ import annotations

import os
import shutil
import subprocess  # nosec B404 # the check runs as another user, in a child
import sys
from pathlib import Path

import pytest

from streamload.servers.seed import Seeder


def _refused(cache_dir: Path, port: int = 0) -> str:
    try:
        seeder = Seeder(cache_dir, "127.0.0.1", port)
    except ValueError as exc:
        return str(exc)
    seeder.close()  # the check failed: a port left listening would outlive the test
    raise AssertionError(f"Seeder({cache_dir}, port={port}) was accepted")


def test_a_missing_folder_or_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert str(missing) in _refused(missing) and "no such folder" in _refused(missing)
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    message = _refused(a_file)
    assert str(a_file) in message and "not a folder" in message and "\n" not in message


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_a_port_out_of_range_is_refused_naming_it(tmp_path: Path, port: int) -> None:
    message = _refused(tmp_path, port)
    assert f"port {port}" in message and "0..65535" in message


@pytest.mark.parametrize("mode", [0o300, 0o600, 0o000])
def test_an_unreadable_folder_is_refused_naming_it(mode: int) -> None:
    """A folder this user cannot list (0o300) or enter (0o600): as user 65534 where the tests run as root
    (root reads any folder), in a folder of /tmp that user can reach."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="streamload-seed-args-"))
    try:
        cache = root / "cache"
        cache.mkdir()
        command = [sys.executable, "-c", "import sys\nfrom streamload.servers.seed import Seeder\n"
                   f"try:\n    Seeder({str(cache)!r}, '127.0.0.1', 0).close()\nexcept ValueError as exc:\n"
                   "    print(exc)\n    sys.exit(3)\n"]  # fmt: skip
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: root reads any folder")
            os.chmod(root, 0o755)  # nosec B103 # a test's own folder, that user 65534 must reach
            os.chown(cache, 65534, 65534)
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        os.chmod(cache, mode)
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=root)  # nosec B603 # fixed argv
        if "ModuleNotFoundError" in out.stderr:
            pytest.skip(f"streamload cannot be imported as user 65534 here: {out.stderr.strip()[-200:]}")
        said = (out.stdout, out.stderr)
        assert out.returncode == 3 and str(cache) in out.stdout and "cannot read" in out.stdout, said
    finally:
        if (root / "cache").exists():
            os.chmod(root / "cache", 0o700)  # so that it can be removed whoever runs the tests
        shutil.rmtree(root, ignore_errors=True)
