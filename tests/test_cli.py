"""The command line: the demo runs end to end; bad arguments give a one-line message and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import streamload
from streamload.cli import main
from streamload.demo import Shape, llama_tensors, write_checkpoint

from .conftest import same_bits


def test_demo_checkpoint_is_llama_shaped_and_loads(tmp_path: Path) -> None:
    shape = Shape(vocab=64, hidden=32, intermediate=48, layers=3)
    write_checkpoint(tmp_path, shape, shards=2)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    state = streamload.load(tmp_path, device="cpu")
    assert {n: tuple(t.shape) for n, t in state.items()} == llama_tensors(shape)
    for f in tmp_path.glob("*.safetensors"):
        for name, t in load_file(f).items():
            assert same_bits(state[name], t)


def test_demo_command_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "streamload", "demo", "--warm", "--keep", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "111 tensors" in out.stdout and "GB/s" in out.stdout and "first full layer" in out.stdout


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
