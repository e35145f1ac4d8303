"""One record per quantization method (streamload/quant/methods.py) is what every consumer reads: each
tensor-name ending a record holds is recognized alike by `streamload inspect` (identify.describe) and
by from_pretrained's refusal of a quantized checkpoint, and a method the table lacks is refused in one
line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import streamload
from streamload.quant.identify import describe
from streamload.quant.methods import ENDINGS, METHODS, SCALES, WEIGHTS, dequantization

LAYER = "model.layers.0.mlp.down_proj"


def _partner(ending: str) -> str | None:
    """What a generic ending counts beside (GPTQ's `.scales` beside `.qweight`, MXFP4's `_blocks` beside
    `_scales`), else None."""
    method = next((m for m in METHODS.values() if ending in m.generic), None)
    if method is None:
        return None
    return method.weights[0] if ending in method.scales else method.scales[0]


def _plain(folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A tiny plain llama checkpoint, no quantization_config, holding `extra` besides its own tensors."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=32, tie_word_embeddings=False)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors")) | extra
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_the_endings_are_one_list_of_every_records_own() -> None:
    every = {e for m in METHODS.values() for e in (*m.scales, *m.weights, *m.others)}
    assert set(ENDINGS) == every and len(ENDINGS) == len(every)
    assert set(SCALES) | set(WEIGHTS) <= every
    assert all(set(m.generic) <= set(m.scales) | set(m.weights) and m.weights and m.scales
               for m in METHODS.values() if m.generic)  # fmt: skip


@pytest.mark.parametrize("ending", ENDINGS)
def test_every_ending_of_the_table_is_read_alike_by_inspect_and_from_pretrained(tmp_path: Path, ending: str) -> None:
    """`streamload inspect` counts a record's scale or weight ending as one; from_pretrained, given a plain
    model's checkpoint that also holds it (no quantization_config), refuses it as quantized, naming it."""
    extra = {LAYER + ending: torch.zeros(4, dtype=torch.int32)}
    if (weight := _partner(ending)) is not None:
        extra[LAYER + weight] = torch.zeros(4, dtype=torch.int32)
    folder = _plain(tmp_path / "model", extra)
    found = describe(streamload.inspect(folder), config={})
    if ending in SCALES:
        assert found is not None and found.scales == 1 and found.scale_names == ("*" + ending,)
    elif ending in WEIGHTS:
        assert found is not None and found.weights == 1
    said = rf"the checkpoint is quantized \(it holds .*{LAYER}{ending}.*nothing was read"
    with pytest.raises(streamload.UnsupportedError, match=said):
        streamload.from_pretrained(folder, device="cpu")


@pytest.mark.parametrize("ending", sorted({e for m in METHODS.values() for e in m.generic}))
def test_a_generic_ending_without_its_partner_is_a_plain_models_tensor(tmp_path: Path, ending: str) -> None:
    """A plain model may name a tensor `layer_scales` or `rotary_blocks`: without its partner (the weight a
    scale scales, the scale of a weight) it is neither counted nor taken for a quantized checkpoint (the
    mismatch is named as any other, and strict=False loads the model)."""
    folder = _plain(tmp_path / "model", {LAYER + ending: torch.zeros(4)})
    assert describe(streamload.inspect(folder), config={}) is None
    with pytest.raises(streamload.StreamloadError, match=r"unexpected keys: .*nothing was read") as raised:
        streamload.from_pretrained(folder, device="cpu")
    assert "quantized" not in str(raised.value)
    assert streamload.from_pretrained(folder, device="cpu", strict=False) is not None


def test_a_method_absent_from_the_table_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(streamload.UnsupportedError, match=r"^quant_method 'hqq': streamload knows fp8, mxfp4, ") as e:
        dequantization("hqq", ["x.weight"])
    assert "\n" not in str(e.value)
    with pytest.raises(streamload.UnsupportedError, match=r"^quant_method 'gptq': streamload computes .*fp8, mxfp4"):
        dequantization("gptq", ["x.qweight", "x.scales"])
    found = dequantization("fp8", ["x.weight", "x.weight_scale_inv", "y.weight"])
    assert found.pairs == {"x.weight": ("x.weight", "x.weight_scale_inv")}


def test_what_a_config_leaves_unsaid_comes_from_its_methods_record(tmp_path: Path) -> None:
    """The bits and group `inspect` shows where a config does not state them are its record's."""
    from .conftest import write_raw

    folder = tmp_path / "model"
    folder.mkdir()
    write_raw(folder / "model.safetensors", {"x.weight": ("F8_E4M3", [2, 2], bytes(4)),
                                             "x.weight_scale_inv": ("F32", [1, 1], bytes(4))})  # fmt: skip
    for name, record in METHODS.items():
        found = describe(streamload.inspect(folder), config={"quantization_config": {"quant_method": name}})
        assert found is not None and found.method == name
        assert (found.bits, found.group) == (record.bits or 8, record.group), name  # float8 weights: 8 bits
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    assert describe(streamload.inspect(folder)).line().startswith("quantization: mxfp4 (4-bit, blocks of 32)")
