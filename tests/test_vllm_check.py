"""`streamload vllm-check`: its comparison, on tensors described as the engines' ranks describe them (the
engines themselves run in tests/test_vllm.py); a path that is not a model folder named before vLLM is
imported; and a whole check on a CPU where none of vLLM's CPU variables is set."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload.integrations.vllm.check import Report, _describe, compare

from .cli_runs import cli, one_line_error


def test_identical_tensors_agree_and_every_kind_of_difference_is_named() -> None:
    w, b = torch.arange(6.0).reshape(2, 3), torch.zeros(3, dtype=torch.bfloat16)
    vllm = [{"w": _describe(w), "b": _describe(b), "scale": _describe(torch.tensor(2.0))}]
    assert (
        compare(vllm, [{"w": _describe(w.clone()), "b": _describe(b.clone()), "scale": _describe(torch.tensor(2.0))}])
        == []
    )
    flipped = w.clone()
    flipped[1, 2] = -5.0
    ours = [{"w": _describe(flipped), "b": _describe(b.float()), "extra": _describe(torch.ones(1))}]
    assert compare(vllm, ours) == [
        "'b' is torch.float32[3] through streamload, torch.bfloat16[3] through vLLM",
        "'extra' only in streamload's model",
        "'scale' only in vLLM's model",
        "'w' torch.float32[2, 3]: sum 5.0 through streamload, 15.0 through vLLM; first values [0.0, 1.0, 2.0, 3.0] "
        "against [0.0, 1.0, 2.0, 3.0]",
    ]


def test_ranks_are_named_and_the_report_reads_as_one_line() -> None:
    one, other = _describe(torch.ones(2)), _describe(torch.zeros(2))
    differences = compare([{"w": one}, {"w": one}], [{"w": one}, {"w": other}])
    assert differences == [
        "rank 1: 'w' torch.float32[2]: sum 0.0 through streamload, 2.0 through vLLM; first values [0.0, 0.0] "
        "against [1.0, 1.0]"
    ]
    report = Report("m", 2, tensors=1, differences=differences)
    assert not report.ok and str(report).startswith("streamload differs from vLLM's default loader in 1 tensor(s); ")
    assert str(Report("m", 2, tensors=7)) == (
        "streamload and vLLM's default loader agree: 2 ranks, 7 tensors each, byte for byte"
    )


def test_vllm_check_of_a_path_that_is_not_there_is_one_line_before_vllm_is_imported(tmp_path: Path) -> None:
    started = time.monotonic()
    for missing in ("/nope", str(tmp_path / "model"), "./model-typo"):
        one_line_error(cli("vllm-check", missing, timeout=60), f"{missing}: no such directory")
    assert time.monotonic() - started < 30  # vLLM's imports alone take ~20 s


def test_vllm_check_api_names_a_missing_path_and_a_file(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from streamload.base.errors import MissingFileError, SourceError
    from streamload.integrations.vllm.check import check

    with pytest.raises(MissingFileError, match=r"^/nope: no such directory \(nor a Hugging Face model id\)$"):
        check("/nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SourceError, match="not a model directory"):
        check(str(tmp_path / "model.safetensors"))


def vllm_check_without_cpu_variables(folder: Path, environment: dict[str, str]) -> dict[str, Any]:
    """`streamload vllm-check` of a tiny Llama, where none of vLLM's VLLM_CPU_* variables is set: run by
    the engines (tests/vllm_engines.py, beside the suite)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "tiny")
    env = {k: v for k, v in environment.items() if not k.startswith("VLLM_CPU_")}
    run = cli("vllm-check", str(folder / "tiny"), env=env, timeout=400)
    return {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}


def test_vllm_check_runs_on_a_cpu_without_vllms_cpu_variables(engines: dict[str, Any]) -> None:
    """vLLM's CPU worker reserves 92% of the machine's memory for its KV cache unless told otherwise, and
    refuses to start where less is free: the check sizes the cache for its 256 tokens itself."""
    run = engines["vllm-check/without-cpu-variables"]
    assert run["returncode"] == 0, run["stderr"][-3000:]
    agree = r"streamload and vLLM's default loader agree: 1 rank, \d+ tensors each, byte for byte$"
    assert re.search(agree, run["stdout"]), run["stdout"]
