"""`streamload inspect` names a checkpoint's quantization in one line: checkpoints synthesized in each
format's real layout (the names, dtypes and shapes its writers use, and its `quantization_config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import streamload
from streamload.cli import main
from streamload.quantization import describe

from .conftest import write_raw


def raw(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    return bytes(torch.zeros(shape, dtype=dtype).view(-1).view(torch.uint8).numpy())


def checkpoint(folder: Path, tensors: dict[str, tuple[str, list[int], bytes]], quantization: dict | None) -> Path:
    folder.mkdir()
    write_raw(folder / "model.safetensors", tensors)
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def norms(n: int = 2) -> dict[str, tuple[str, list[int], bytes]]:
    return {f"model.layers.{i}.input_layernorm.weight": ("BF16", [256], raw(torch.bfloat16, (256,))) for i in range(n)}


def fp8_block(folder: Path) -> Path:  # DeepSeek-V3 / Qwen3-FP8: F8_E4M3 weights, a float32 scale per 128x128 block
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        tensors[p + "weight"] = ("F8_E4M3", [256, 256], raw(torch.float8_e4m3fn, (256, 256)))
        tensors[p + "weight_scale_inv"] = ("F32", [2, 2], raw(torch.float32, (2, 2)))
    return checkpoint(folder, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "fmt": "e4m3", "weight_block_size": [128, 128]})  # fmt: skip


def compressed_w4a16(folder: Path) -> Path:  # compressed-tensors pack-quantized: eight int4 in an int32
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        tensors[p + "weight_packed"] = ("I32", [256, 32], raw(torch.int32, (256, 32)))
        tensors[p + "weight_scale"] = ("BF16", [256, 2], raw(torch.bfloat16, (256, 2)))
        tensors[p + "weight_shape"] = ("I64", [2], raw(torch.int64, (2,)))
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 128}}  # fmt: skip
    return checkpoint(folder, tensors, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                        "config_groups": {"group_0": scheme}})  # fmt: skip


def gptq(folder: Path) -> Path:  # GPTQ: qweight/qzeros int32, scales float16, g_idx
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        tensors[p + "qweight"] = ("I32", [32, 256], raw(torch.int32, (32, 256)))
        tensors[p + "qzeros"] = ("I32", [2, 32], raw(torch.int32, (2, 32)))
        tensors[p + "scales"] = ("F16", [2, 256], raw(torch.float16, (2, 256)))
        tensors[p + "g_idx"] = ("I32", [256], raw(torch.int32, (256,)))
    return checkpoint(folder, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})


def mxfp4(folder: Path) -> Path:  # gpt-oss: experts' weights as 4-bit blocks of 32 with a shared exponent
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        tensors[p + "gate_up_proj_blocks"] = ("U8", [4, 512, 8, 16], raw(torch.uint8, (4, 512, 8, 16)))
        tensors[p + "gate_up_proj_scales"] = ("U8", [4, 512, 8], raw(torch.uint8, (4, 512, 8)))
        tensors[p + "gate_up_proj_bias"] = ("BF16", [4, 512], raw(torch.bfloat16, (4, 512)))
    return checkpoint(
        folder, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    )


def fp8_without_config(folder: Path) -> Path:
    path = fp8_block(folder)
    (path / "config.json").unlink()
    return path


CASES = {
    "fp8-block": (
        fp8_block,
        "quantization: fp8 (8-bit, blocks of 128x128); 2 quantized weights stored as F8_E4M3; "
        "2 scale tensors: *.weight_scale_inv",
    ),
    "compressed-tensors-w4a16": (
        compressed_w4a16,
        "quantization: compressed-tensors pack-quantized int (4-bit, "
        "groups of 128); 2 quantized weights stored as I32; 2 scale tensors: *.weight_scale",
    ),
    "gptq": (
        gptq,
        "quantization: gptq (4-bit, groups of 128); 2 quantized weights stored as I32; 6 scale "
        "tensors: *.g_idx, *.qzeros, *.scales",
    ),
    "mxfp4": (
        mxfp4,
        "quantization: mxfp4 (4-bit, blocks of 32); 2 quantized weights stored as U8; 2 scale tensors: *_scales",
    ),
    "fp8-no-config": (
        fp8_without_config,
        "quantization: float8 weights (8-bit); 2 quantized weights stored as "
        "F8_E4M3; 2 scale tensors: *.weight_scale_inv",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_inspect_names_the_quantization_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, line = CASES[case]
    folder = make(tmp_path / case)
    assert main(["inspect", str(folder)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert line in printed, printed
    assert main(["inspect", "--json", str(folder)]) == 0
    shown = json.loads(capsys.readouterr().out)["quantization"]
    assert shown == json.loads(json.dumps(describe(streamload.inspect(folder))._asdict()))


def test_plain_weights_show_no_quantization(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A plain model may hold a tensor named like a scale (`layer_scales`, `.scales`): no weight beside it.
    tensors = norms() | {"model.layer_scales": ("F32", [4], raw(torch.float32, (4,))),
                         "model.norm.scales": ("F32", [4], raw(torch.float32, (4,)))}  # fmt: skip
    folder = checkpoint(tmp_path / "plain", tensors, None)
    assert describe(streamload.inspect(folder)) is None
    assert main(["inspect", str(folder)]) == 0
    assert "quantization" not in capsys.readouterr().out
