"""What the suite leaves behind and whom it asks: its caches and temporary files in a folder of the session's
own (tests/conftest.py's `suite_environment`, removed at the end), nothing written into the user's caches,
no address off the machine asked; and one vLLM engine's failure failing only the tests that read it."""

from __future__ import annotations

import ipaddress
import os
import pwd
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import streamload

from .conftest import have_vllm

ROOT = Path(__file__).resolve().parent.parent
CACHES = ("HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "HF_HOME", "XDG_CACHE_HOME", "TMPDIR")
SHOWN = "import os, tempfile; print(*(os.environ.get(n, '') for n in {names!r}), tempfile.gettempdir(), sep='\\n')"


def session_folder() -> Path:
    folder = os.environ.get("STREAMLOAD_SUITE_TEMP")
    assert folder, "the suite set no temporary folder of its own (STREAMLOAD_SUITE_TEMP): it caches in the user's"
    return Path(folder)


def test_caches_and_temporary_files_are_the_sessions_own() -> None:
    """vLLM's compile cache and records, the hub's cache, other tools' caches and vLLM's sockets: under the
    session's folder, here and in a process the tests start, never under the user's home."""
    folder = session_folder()
    real_home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert folder.is_dir() and not folder.is_relative_to(real_home)
    assert Path.home().resolve().is_relative_to(folder)  # HOME: what defaults to ~ lands in the session's folder
    for name in CACHES:
        assert Path(os.environ.get(name, "~")).expanduser().resolve().is_relative_to(folder), name
    assert Path(tempfile.gettempdir()).resolve().is_relative_to(folder)
    shown = SHOWN.format(names=CACHES)
    child = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True, check=True)
    for name, said in zip((*CACHES, "tempfile.gettempdir()"), child.stdout.splitlines(), strict=True):
        assert said and Path(said).resolve().is_relative_to(folder), (name, said)


@pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed")
def test_vllm_finds_the_sessions_cache_root() -> None:
    """What vLLM itself reads (its compile cache, its model-info records; streamload's compiled records)."""
    import vllm.envs

    from streamload.integrations.vllm.startup import compiled

    folder = session_folder()
    for root in (vllm.envs.VLLM_CACHE_ROOT, vllm.envs.VLLM_CONFIG_ROOT, compiled.cache_root()):
        assert Path(root).resolve().is_relative_to(folder), root
    assert vllm.envs.VLLM_NO_USAGE_STATS  # no statistics sent to vLLM's server


def test_an_s3_load_without_credentials_asks_no_address_off_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3 client given no keys asks the cloud's instance-metadata address (169.254.169.254) for a role's:
    in the suite, a closed loopback port instead (obstore's AWS_METADATA_ENDPOINT; boto3's
    AWS_EC2_METADATA_DISABLED), so the load fails at once, on this machine."""
    endpoint = urlsplit(os.environ.get("AWS_METADATA_ENDPOINT", "http://169.254.169.254"))
    assert ipaddress.ip_address(endpoint.hostname or "").is_loopback, endpoint.geturl()  # before anything is asked
    assert os.environ.get("AWS_EC2_METADATA_DISABLED") == "true"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("STREAMLOAD_RETRIES", "0")
    with pytest.raises(Exception) as caught:
        streamload.load("s3://bucket/model.safetensors", device="cpu")
    said = f"{caught.value} {caught.value.__cause__!r}"
    assert "127.0.0.1:9" in said and "169.254" not in said, said


def test_a_passing_tests_temporary_files_are_not_kept(tmp_path: Path) -> None:
    """The suite writes gigabytes of checkpoints under pytest's temporary directory: with this
    project's settings only a failed test's are kept to look at (pytest keeps every test's of the last
    three runs otherwise: ~1.3 GB)."""
    (tmp_path / "test_two.py").write_text(
        "def test_passes(tmp_path):\n    (tmp_path / 'ckpt').write_bytes(b'x')\n\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'ckpt').write_bytes(b'x')\n    assert False\n"
    )
    base = tmp_path / "base"
    argv = ["-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
            "--basetemp", str(base), str(tmp_path / "test_two.py")]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "pytest", *argv], capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    kept = sorted(p.name for p in base.iterdir() if not p.is_symlink()) if base.exists() else []
    assert kept == ["test_fails0"], kept


def test_one_engines_error_fails_only_the_tests_that_read_it() -> None:
    """The engines' results (tests/conftest.py's `engines`): a key whose engine raised (or the scenario it
    belongs to) fails with that engine's traceback; the other engines' results read as recorded."""
    from .conftest import EngineResults

    errors = {"llama/tp2/streamload": "Traceback ...\nRuntimeError: rank 1 died\n"}
    results = EngineResults({"llama/safetensors": {"tokens": [[1]]}, "seconds": {}, "errors": errors})
    assert results["llama/safetensors"] == {"tokens": [[1]]}
    for key in ("llama/tp2/streamload", "llama/tp2/streamload/reloaded"):
        with pytest.raises(pytest.fail.Exception, match=r"'llama/tp2/streamload' failed(?s:.*)rank 1 died"):
            results[key]
    with pytest.raises(KeyError):  # a key no engine was to record: the test's own mistake
        results["llama/nothing"]
    died = EngineResults({"seconds": {}, "died": {"--quantized": "the engines' run --quantized ended (-9) ..."}})
    with pytest.raises(pytest.fail.Exception, match=r"recorded no 'quantized/awq/new'(?s:.*)--quantized ended \(-9\)"):
        died["quantized/awq/new"]


def test_the_users_caches_got_nothing(users_caches: Callable[[], list[str]]) -> None:
    """Runs after every other test (tests/conftest.py): where the user's vLLM cache and config, hub cache and
    ~/.cache would be (under the run's own HOME, which no other program writes) no entry was made."""
    assert users_caches() == []
