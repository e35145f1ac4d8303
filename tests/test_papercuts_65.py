"""Papercuts of issue 65, one test each: what vLLM users pass (`model_loader_extra_config=None`), a folder
this user may not list, arguments of the wrong kind, `compile-cache publish` on a full disk, an index
that maps no tensor, `bench --json` into a folder it cannot write, and the README's summary of `load`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import streamload
from streamload.commands.demo import Shape, write_checkpoint

from .conftest import Mount

ROOT = Path(__file__).parent.parent
NOBODY = 65534


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real command, in its own process (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "streamload", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def small_checkpoint(folder: Path) -> Path:
    write_checkpoint(folder, Shape(vocab=64, hidden=32, intermediate=48, layers=2), shards=2)
    return folder


def test_vllm_options_none_is_no_options() -> None:
    """vLLM's own default for `model_loader_extra_config`, which its loaders take: no options, not an error."""
    from streamload.integrations.vllm.options import check_options

    assert check_options(None) == {}
    with pytest.raises(ValueError, match="must be a dict, not list"):
        check_options([])


def test_a_folder_this_user_may_not_list_is_a_source_error_naming_it() -> None:
    """Root reads every folder, so the load runs as nobody (a process of its own that drops to that user
    once streamload is imported); as another user, in this process."""
    # (the session's temporary folders are root's alone: nobody could not reach a folder in them at all)
    base = Path(tempfile.mkdtemp(prefix="streamload-locked-", dir="/tmp" if os.geteuid() == 0 else None))
    try:
        base.chmod(0o755)
        for name, mode in (("open", 0o755), ("locked", 0o000), ("unlisted", 0o311)):  # not entered; not listed
            (base / name).mkdir()
            small_checkpoint(base / name)
            if name == "unlisted":  # found by listing its files (with an index, it loads: nothing is listed)
                (base / name / "model.safetensors.index.json").unlink()
            (base / name).chmod(mode)
        code = (
            "import os, sys, streamload\n"
            "streamload.load(sys.argv[1] + '/open')  # every module a load uses imported, before the switch\n"
            f"os.getuid() == 0 and os.setuid({NOBODY})\n"
            "for name in ('locked', 'locked/model-00001-of-00002.safetensors', 'unlisted'):\n"
            "    try:\n"
            "        streamload.load(f'{sys.argv[1]}/{name}')\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, isinstance(exc, streamload.StreamloadError), exc)\n"
        )
        run = subprocess.run([sys.executable, "-c", code, str(base)], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        if "Operation not permitted" in run.stderr:
            pytest.skip(f"cannot switch to user {NOBODY} here")
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert len(lines) == 3, run.stdout
        for line, name in zip(lines, ("locked", "locked/model-00001-of-00002.safetensors", "unlisted"), strict=True):
            assert line.startswith(f"SourceError True {base}/{name}: "), line
            assert "Permission denied" in line, line
    finally:
        for child in base.iterdir():
            child.chmod(0o755)
        shutil.rmtree(base)


def test_arguments_of_the_wrong_kind_are_named() -> None:
    """`layer_of(5)` names its argument (not the regular expression's TypeError), and a list source names
    the element that is not a path (not "not list")."""
    with pytest.raises(TypeError, match=r"^layer_of: name must be a tensor name \(text\), not int 5$"):
        streamload.layer_of(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^source\[1\] must be a path or a URL, not int 5$"):
        streamload.load(["model.safetensors", 5])  # type: ignore[list-item]


def test_compile_cache_publish_on_a_full_disk_names_the_file_and_leaves_no_folder(mount: Mount, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    cache_root = tmp_path / "vllm-cache"
    (cache_root / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache_root / "torch_compile_cache" / "abc" / "artifact").write_bytes(os.urandom(1 << 20))
    disk = mount(size=64 << 10)  # a checkpoint's folder with no room for a 1 MB archive
    run = cli("compile-cache", "publish", str(disk), "--cache-root", str(cache_root), timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("streamload: error:")]
    assert len(errors) == 1, run.stderr
    assert "No space left on device" in errors[0] and f"{disk}/streamload-compile-cache/" in errors[0], errors[0]
    assert list(disk.iterdir()) == []  # neither a half-written archive nor the folder publish made


def test_an_index_that_maps_no_tensor_is_warned_of(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}}')
    with pytest.warns(UserWarning, match=re.escape(f"{index}: its weight_map is empty")):
        assert streamload.load(tmp_path) == {}


def test_bench_into_a_folder_it_cannot_write_fails_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mount: Mount
) -> None:
    import streamload.commands.bench
    from streamload.commands.cli import main

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran before its output's folder was checked")

    monkeypatch.setattr(streamload.commands.bench, "bench", ran)
    (tmp_path / "model").mkdir()
    folder = small_checkpoint(tmp_path / "model")
    missing = tmp_path / "no-such-folder" / "b.json"
    assert main(["bench", str(folder), "--device", "cpu", "--json", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"streamload: error: --json {missing}: cannot write there: No such file or directory" in err, err
    read_only = mount(size=64 << 10, read_only=True) / "b.json"  # refuses root too, where a mode does not
    assert main(["bench", str(folder), "--device", "cpu", "--json", str(read_only)]) == 1
    assert f"--json {read_only}: cannot write there: Read-only file system" in capsys.readouterr().err


def test_the_readme_summary_of_load_names_each_of_its_options() -> None:
    """The README's command-line block shows `load` with every option its parser takes (--cache-dir was left out)."""
    from streamload.commands.cli import _parser

    block = (ROOT / "README.md").read_text().split("## Command line", 1)[1].split("```", 2)[1]
    line = next(x for x in block.splitlines() if x.startswith("streamload load "))
    sub = next(a for a in _parser()._actions if a.dest == "command").choices["load"]  # type: ignore[union-attr]
    options = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert options and not {o for o in options if o not in line}, line
