"""Finding a checkpoint's files: clear errors for every way a source can be wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload

from .cli_runs import ROOT, small_checkpoint

NOBODY = 65534


def shard(path: Path, **tensors: torch.Tensor) -> Path:
    save_file(tensors, path)
    return path


def test_file_dir_list_and_pathlike(tmp_path: Path) -> None:
    a = shard(tmp_path / "a.safetensors", x=torch.ones(2))
    b = shard(tmp_path / "b.safetensors", y=torch.zeros(3))
    assert streamload.load(str(a), device="cpu").keys() == {"x"}
    assert streamload.load(tmp_path, device="cpu").keys() == {"x", "y"}
    assert streamload.load([b, str(a)], device="cpu").keys() == {"x", "y"}
    assert [f.path.name for f in streamload.inspect(tmp_path).files] == ["a.safetensors", "b.safetensors"]


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(streamload.MissingFileError, match="nope") as info:
        streamload.iter(tmp_path / "nope.safetensors")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(streamload.MissingFileError, match="gone"):
        streamload.iter([tmp_path / "gone.safetensors"])


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(streamload.SourceError, match=str(tmp_path)):
        streamload.iter(tmp_path)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    shard(tmp_path / "s1.safetensors", a=torch.ones(1))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(streamload.MissingFileError, match="s2.safetensors") as info:
        streamload.iter(tmp_path)
    assert str(index) in str(info.value)


def test_an_index_named_with_a_variant_is_read_as_an_index(tmp_path: Path) -> None:
    """`save_pretrained(variant="fp16")` names a sharded component's index `<name>.safetensors.index.fp16.json`."""
    shard(tmp_path / "w-00001-of-00002.fp16.safetensors", a=torch.ones(2))
    shard(tmp_path / "w-00002-of-00002.fp16.safetensors", b=torch.zeros(3))
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json"
    index.write_text(json.dumps({"weight_map": {"a": "w-00001-of-00002.fp16.safetensors",
                                                "b": "w-00002-of-00002.fp16.safetensors"}}))  # fmt: skip
    got = streamload.load(index, device="cpu")
    assert set(got) == {"a", "b"} and torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"], torch.zeros(3))


def test_index_maps_tensor_absent_from_shard(tmp_path: Path) -> None:
    shard(tmp_path / "s1.safetensors", a=torch.ones(1))
    shard(tmp_path / "s2.safetensors", b=torch.ones(1))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})
    )
    with pytest.raises(streamload.SourceError, match="'b'.*s1.safetensors"):
        streamload.iter(tmp_path)


@pytest.mark.parametrize("doc", ["{not json", '{"weight_map": [1]}', '{"weight_map": {"a": "../x.safetensors"}}'])
def test_bad_index(tmp_path: Path, doc: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(doc)
    with pytest.raises(streamload.SourceError, match="index"):
        streamload.iter(tmp_path)


def test_an_index_that_maps_no_tensor_is_warned_of(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}}')
    with pytest.warns(UserWarning, match=re.escape(f"{index}: its weight_map is empty")):
        assert streamload.load(tmp_path) == {}


def test_same_tensor_in_two_files(tmp_path: Path) -> None:
    a = shard(tmp_path / "a.safetensors", w=torch.ones(1))
    b = shard(tmp_path / "b.safetensors", w=torch.ones(1))
    with pytest.raises(streamload.SourceError, match="'w'") as info:
        streamload.iter(tmp_path)
    assert str(a) in str(info.value) and str(b) in str(info.value)


def test_unreadable_file() -> None:
    """A file its reader may not open. Root reads any file, so as root the check runs in a child
    process that first drops to the unprivileged user `nobody`."""
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o755)  # reachable by anyone: only the file's own mode forbids it
        a = shard(folder / "a.safetensors", w=torch.ones(1))
        a.chmod(0)
        if os.geteuid() != 0:
            with pytest.raises(streamload.SourceError, match="cannot open"):
                streamload.iter(a)
            return
        pid = os.fork()
        if pid == 0:  # the child: as nobody, 0 when the error is the expected one
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                streamload.iter(a)
            except streamload.SourceError as exc:
                code = 0 if "cannot open" in str(exc) and str(a) in str(exc) else 2
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(folder)


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


def test_directory_given_as_file_in_list(tmp_path: Path) -> None:
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(streamload.SourceError, match="not a regular file"):
        streamload.iter([tmp_path / "d.safetensors"])


def test_open_failure_names_file(tmp_path: Path) -> None:
    a = shard(tmp_path / "a.safetensors", w=torch.ones(1))
    with pytest.raises(streamload.SourceError, match="cannot open") as info:
        streamload.iter([a / "inner.safetensors"])  # ENOTDIR: opening fails although the name looks fine
    assert "inner.safetensors" in str(info.value)


def test_index_shard_symlink_outside_is_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shard(outside / "secret.safetensors", a=torch.ones(1))
    model = tmp_path / "model"
    model.mkdir()
    (model / "s1.safetensors").symlink_to(outside / "secret.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(streamload.SourceError, match="links outside"):
        streamload.iter(model)


def test_a_folder_without_an_index_refuses_a_link_outside_as_an_index_does(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shard(outside / "secret.safetensors", a=torch.ones(1))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(outside / "secret.safetensors")
    with pytest.raises(streamload.SourceError, match="links outside") as info:
        streamload.iter(model)
    assert "model.safetensors" in str(info.value) and str(model) in str(info.value)
    # a link that stays inside the folder, and one into a Hugging Face cache's blobs, still load
    inside = tmp_path / "inside"
    inside.mkdir()
    shard(inside / "real.data", b=torch.ones(1))  # (not listed itself: no .safetensors name)
    (inside / "model.safetensors").symlink_to("real.data")
    assert streamload.load(inside, device="cpu").keys() == {"b"}
    snapshot, blobs = tmp_path / "hub" / "snapshots" / "abc", tmp_path / "hub" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    shard(blobs / ("0" * 64), c=torch.ones(1))
    (snapshot / "model.safetensors").symlink_to(Path("..", "..", "blobs", "0" * 64))
    assert streamload.load(snapshot, device="cpu").keys() == {"c"}
