"""A trainer's steps written atomically (streamload.commands.publish): what a server reads is what was written,
bit for bit, with the digest file `verify=` checks; a step is never half there, and never rewritten."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import streamload
from streamload.commands.publish import publish

from .conftest import same_bits


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, dtype=torch.float16),
        "model.layers.1.input_layernorm.weight": torch.ones(32),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_a_published_step_reads_back_bit_for_bit_and_verifies(tmp_path: Path) -> None:
    state = _state()
    path = publish(state, tmp_path / "run", step=3, shard_bytes=4096)
    assert path == tmp_path / "run" / "step-3"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-3"]  # no temporary left
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1  # cut at shard_bytes, with an index
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    reference = {n: t for f in shards for n, t in load_file(str(f)).items()}  # safetensors' own reader
    got = streamload.load(path, verify=True)  # the digest file written with it
    for name, t in state.items():
        assert same_bits(reference[name], t) and same_bits(got[name], t), name


def test_a_step_is_never_rewritten_nor_left_half_written(tmp_path: Path) -> None:
    publish(_state(), tmp_path, step=1)
    with pytest.raises(FileExistsError, match="step-1"):
        publish(_state(), tmp_path, step=1)
    bad = {"ok": torch.ones(2), "no-name": torch.ones(2, dtype=torch.complex128)}  # no safetensors dtype
    with pytest.raises(TypeError, match="no-name"):
        publish(bad, tmp_path, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # nothing of step 2, not even a temporary


def test_publish_names_what_is_not_a_tensor_and_writes_nothing(tmp_path: Path) -> None:
    cases: list[tuple[object, str]] = [
        ({"a": 3}, "tensor 'a': must be a torch.Tensor, not int 3"),
        ({"w": torch.ones(2), "b": [1.0]}, "tensor 'b': must be a torch.Tensor, not list"),
        ({1: torch.ones(2)}, "tensor names must be text, not int 1"),
        ([("a", torch.ones(2), "extra")], "tensors must be a mapping or (name, tensor) pairs"),
        (torch.ones(2), "tensors must be a mapping of names to tensors, not Tensor"),
    ]
    for tensors, message in cases:
        with pytest.raises(TypeError, match=re.escape(message)):
            publish(tensors, tmp_path / "run", step=1)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
    assert publish({"a": torch.ones(2)}, tmp_path / "run", step=1).name == "step-1"
