"""FP8 block scales stored as E8M0 exponents (MXFP8 checkpoints: one byte a block, as uint8 or as
float8_e8m0fnu) are read as transformers' `Fp8Dequantize` reads them, 2 ** (byte - 127), never as the
raw byte's number: streamload's dequantization against transformers' own, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import streamload

from .conftest import same_bits
from .test_quantization import fp8_kernels, fp8_model, same_as_theirs  # noqa: F401 (a fixture)

E8M0 = {"uint8": torch.uint8, "float8_e8m0fnu": torch.float8_e8m0fnu}


def as_exponents(scale: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """A float32 block scale as the power of two at or above it, stored as its E8M0 byte."""
    byte = (scale.log2().ceil() + 127).clamp(1, 254).to(torch.uint8)
    return byte if stored == torch.uint8 else byte.view(stored)


def mxfp8_llama(folder: Path, stored: torch.dtype) -> Path:
    """A small Llama's FP8 block checkpoint (128x128 blocks) whose scales are E8M0 bytes of `stored`."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
    config = transformers.LlamaConfig(**sizes, tie_word_embeddings=False, dtype="bfloat16")
    fp8_model(folder, transformers.LlamaForCausalLM, config)
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        tensors[name] = as_exponents(tensors[name], stored)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers dequantizes FP8 only without a GPU (or when told)")
@pytest.mark.parametrize("stored", list(E8M0), ids=list(E8M0))
def test_e8m0_block_scales_load_as_transformers_dequantizes_them(tmp_path: Path, stored: str) -> None:
    """transformers' own from_pretrained (no GPU: it dequantizes) reads a uint8 scale as the exponent it
    is, and a float8_e8m0fnu one by torch's conversion: streamload's from_pretrained gives every tensor
    bit for bit and the same logits (a uint8 scale taken as its number made every weight ~2**127 times
    too large or small)."""
    transformers = pytest.importorskip("transformers")
    folder = mxfp8_llama(tmp_path / "mxfp8", E8M0[stored])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = streamload.from_pretrained(folder, device="cpu")
    want, _ = same_as_theirs(theirs, ours)
    assert want["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


@pytest.mark.usefixtures("fp8_kernels")
@pytest.mark.parametrize("stored", list(E8M0), ids=list(E8M0))
def test_e8m0_scales_where_transformers_keeps_fp8_are_refused_before_reading(tmp_path: Path, stored: str) -> None:
    """Where transformers keeps FP8 layers as stored (a GPU of compute capability 8.9 or more), their
    scale parameters are float32: an E8M0 byte is not placed there as a number, it is refused before
    a byte is read, naming the file and the tensor."""
    folder = mxfp8_llama(tmp_path / "mxfp8", E8M0[stored])
    said = rf"model.safetensors: tensor 'model\.layers\.\d\.\S+\.weight_scale_inv' is torch\.{stored}, .*nothing was"
    with pytest.raises(streamload.StreamloadError, match=said):
        streamload.from_pretrained(folder, device="cpu")


def theirs_op() -> object:
    """transformers' own FP8 dequantization operation (the one its loader runs)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "Fp8Dequantize"):
        pytest.skip("this transformers has no Fp8Dequantize")
    return fp8.Fp8Dequantize(None)


@pytest.mark.parametrize("stored", list(E8M0), ids=list(E8M0))
@pytest.mark.parametrize("rows", [2, 256], ids=["few values", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_e8m0_byte_scales_as_transformers_own_operation(
    stored: str, rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the 256 bytes as a block's scale (0: 2**-127, 254: 2**127, 255: inf as uint8, NaN as
    float8_e8m0fnu) times float8 values, through both of `fp8_blocks`' ways (torch's conversion for few
    values, the widening by bits in chunks for many): transformers' `Fp8Dequantize` bit for bit."""
    from streamload.quant import dequantize
    from streamload.quant.dequantize import fp8_blocks

    monkeypatch.setattr(dequantize, "_CHUNK", 2 * 256)  # two rows a chunk: many chunks
    op = theirs_op()
    values = torch.stack([torch.arange(256, dtype=torch.uint8).roll(i) for i in range(rows)])
    weight = values.masked_fill(values.view(torch.float8_e4m3fn).float().isnan(), 0).view(torch.float8_e4m3fn)
    for first in range(0, 256, 16):  # 16 bytes a grid: [rows / 1 row, 16 blocks of 16 columns] ...
        grid = torch.arange(first, first + 16, dtype=torch.uint8).repeat(rows, 1)
        scale = grid if E8M0[stored] == torch.uint8 else grid.view(E8M0[stored])
        want = op._dequantize_one(weight, scale, output_dtype=dtype)
        assert same_bits(fp8_blocks(weight, scale, dtype), want), (stored, first)
        if first == 240 and E8M0[stored] == torch.uint8:  # ... the last byte's blocks: inf (NaN where 0 x inf)
            assert fp8_blocks(weight, scale, dtype)[:, -16:].float().isinf().any()
