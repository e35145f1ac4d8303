"""Quantized checkpoints on real vLLM engines (vLLM's CPU build): every quantization its CPU build loads, in
its real layout (testbed/quantized_layouts.py), dense and mixtures of experts: every tensor right after
`load_weights` equal to vLLM's default loader's in each of streamload's modes and at TP=2; where the kernel
runs here (or on tests/vllm_reference_kernels.py's), greedy tokens and an in-place reload of other weights,
against vLLM's own loader and reload; a flipped byte refused with `verify`."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import streamload
from testbed import quantized_layouts

from .test_vllm import assert_same_weights, kept_params, param_digests
from .vllm_engines import (
    KV_CACHE,
    SMALL,
    Timed,
    check_result,
    close,
    engine,
    error_of,
    raise_if_broken,
    recording,
    scenario,
    state,
    tokens,
)

# What each quantized checkpoint is loaded with, at one rank and at two: streamload's options, each
# against one load by vLLM's default loader (check_modes).
QUANTIZED_MODES = {"default": {}, "direct": {"direct": True}, "whole": {"direct": False}, "verify": {"verify": True}}
QUANTIZED_TP2_MODES = {"default": {}, "cooperative": {"cooperative": True}}
# Scales by channel, and packed int4 in groups along sharded rows with `g_idx`. (Every other layout, and the
# Qwen3-MoE ones, passed at TP=2 as well, ~10-25 s each on 2 cores: `STREAMLOAD_QUANTIZED_TP2=all` runs them;
# left out of the suite for its time.)
QUANTIZED_TP2 = ("w8a8-int8", "gptq")
# Those whose kernels run here (FP8 with block scales and the 4-bit ones on tests/vllm_reference_kernels.py's):
# greedy tokens and `reload_weights`. (W4A16 by channel and GPTQ with and without `g_idx` passed as well,
# ~15 s each on 2 cores: `STREAMLOAD_QUANTIZED_KERNELS=all` runs them; left out of the suite for its time.)
QUANTIZED_KERNELS = ("w8a8-int8", "w8a8-int8-tensor", "fp8-channel", "w4a8", "fp8-block", "w4a16-group", "awq")
if os.environ.get("STREAMLOAD_QUANTIZED_KERNELS") == "all":
    QUANTIZED_KERNELS += ("w4a16-channel", "gptq", "gptq-g-idx")
HALF = {*quantized_layouts.GPTQ_OR_AWQ, "fp8-block"}  # vLLM runs these in float16 or bfloat16 only
# Mixtures of experts (testbed/quantized_layouts.py's MOE_CONFIGS), whose MoE kernels this CPU lacks: vLLM's
# parameters and weight loaders, the experts' forward on tests/vllm_reference_kernels.py's reference, in
# bfloat16 (as their checkpoints are). At TP=2, gpt-oss (its own load_weights narrows the fused experts, with
# their scales, and zeroes on rank 1 the down projection's bias it is handed).
QUANTIZED_MOE_TP2 = ("gpt-oss-mxfp4",)
if os.environ.get("STREAMLOAD_QUANTIZED_TP2") == "all":
    QUANTIZED_TP2, QUANTIZED_MOE_TP2 = tuple(quantized_layouts.CONFIGS), tuple(quantized_layouts.MOE_CONFIGS)


def _dtype(layout: str) -> str:
    return "bfloat16" if layout in HALF else "float32"


@functools.cache
def layouts(root: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """Every dense layout (with its digest file), and those whose kernels run here again with other weights
    (what their engines reload)."""
    from streamload.pipeline.verify import write_digests

    paths = quantized_layouts.make(root, SMALL)
    new = quantized_layouts.make(root, SMALL, list(QUANTIZED_KERNELS), seed=31)
    for path in paths.values():  # `streamload digest`: what verify=True checks against
        write_digests(streamload.inspect(path))
    return paths, new


@scenario("quantized")
def quantized_checkpoints(root: Path, out: Timed) -> None:
    from streamload.integrations.vllm.check import check_modes

    paths, _ = layouts(root)
    for layout, path in paths.items():
        dtype = _dtype(layout)
        with recording(out, f"check/quantized/{layout}"):
            raise_if_broken()
            for mode, report in check_modes(str(path), QUANTIZED_MODES, dtype=dtype, **KV_CACHE).items():
                out[f"check/quantized/{layout}/{mode}"] = check_result(report)
        if layout in QUANTIZED_TP2:
            with recording(out, f"check/quantized/{layout}/tp2"):
                for mode, report in check_modes(str(path), QUANTIZED_TP2_MODES, tp=2, dtype=dtype, **KV_CACHE).items():
                    out[f"check/quantized/{layout}/tp2/{mode}"] = check_result(report)


QUANTIZED_CASES = [f"{layout}/{mode}" for layout in quantized_layouts.CONFIGS for mode in QUANTIZED_MODES] + [
    f"{layout}/tp2/{mode}" for layout in QUANTIZED_TP2 for mode in QUANTIZED_TP2_MODES
]


# vLLM's parameters (and buffers): 2 layers' fused qkv, o, gate_up and down with their scales (and
# zero points, packed shapes), the norms, embeddings and head.
QUANTIZED_PARAMETERS = {"w8a8-int8": 44, "w8a8-int8-tensor": 44, "fp8-channel": 44, "w4a8": 44, "w4a16-group": 52,
                        "w4a16-channel": 52, "fp8-block": 40, "gptq": 40, "gptq-g-idx": 40, "awq": 40}  # fmt: skip
# Tensors that go whole through load_weights, of the 2 layers' 14 linear layers' (the dry run's reason
# in the load report): per-tensor scales written by index into one slot per fused shard, the one
# `weight_shape` of fused shards, GPTQ/AWQ's packed columns of fused qkv and gate_up.
QUANTIZED_WHOLE = {"w8a8-int8-tensor": 10, "w4a16-group": 10, "w4a16-channel": 10, "gptq": 30, "gptq-g-idx": 30,
                   "awq": 30}  # fmt: skip


@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_a_quantized_checkpoint_equals_vllms_own_loader(engines: dict[str, Any], case: str) -> None:
    """Each quantization vLLM's CPU build loads, in its real layout (compressed-tensors W8A8 int8 by
    channel and tensor, FP8, W4A16 packed by group and channel, W4A8; GPTQ with and without `g_idx`;
    AWQ; FP8 with block scales, DeepSeek-V3's, whose kernel this CPU lacks: the engines run it on a
    reference kernel, vLLM's own parameters and weight loaders unchanged): every parameter (packed
    weights, scales, zero points) equals vLLM's default loader's right
    after `load_weights`, placed straight into the parameters (by default and `direct`), read whole,
    with `verify`, and at TP=2, on its own and `cooperative`."""
    layout = case.partition("/")[0]
    unused = 14 if layout == "gptq-g-idx" else 0  # vLLM has no g_idx: never read
    _identical(engines[f"check/quantized/{case}"], case, QUANTIZED_PARAMETERS[layout], QUANTIZED_WHOLE.get(layout, 0),
               unused)  # fmt: skip


def _identical(result: dict[str, Any], case: str, tensors: int, whole: int, unused: int = 0) -> None:
    """A quantized check's `result`: every parameter as vLLM's default loader left it (`tensors` of
    them), placed straight into the parameters where the dry run saw a plain copy, `whole` of them
    through load_weights with the reason (one weight_shape for fused shards, a per-shard scale
    indexed, packed columns of gate_up), `unused` never read; read whole in the mode that says so."""
    assert result["ok"], result["differences"]
    assert result["tensors"] == tensors
    report = result["report"]
    if "/tp2/" in case:  # (the report of a rank in another process is not seen here)
        return
    if case.endswith("/whole"):
        assert report["direct"] == 0 and report["through_model"] > 0, report
        return
    assert report["direct"] > 0 and not report["diverged"], report
    assert report["through_model"] == whole, report
    assert bool(report["through_model"]) == bool(report["why_whole"]), report
    assert report["unused"] == unused, report


# Defined, so run, before `refused_with_verify`: a MoE engine after that refused load fails ("expert parallel
# group is not initialized"), the failed dense engine's parallel state (without one) left behind in this process.
@scenario("quantized")
def quantized_moe(root: Path, out: Timed) -> None:
    """Quantized mixtures of experts (compressed-tensors W4A16, FP8 with block scales, gpt-oss's MXFP4)
    whose MoE kernels this CPU lacks: every tensor right after `load_weights` against vLLM's default loader
    in each mode (and at TP=2); greedy tokens from both loaders on the reference kernels, and after an
    in-place reload of other weights."""
    from streamload.integrations.vllm.check import check_modes
    from streamload.pipeline.verify import write_digests

    paths = quantized_layouts.make_moe(root)
    (root / "reloaded").mkdir()
    new = quantized_layouts.make_moe(root / "reloaded", seed=41)
    for layout, path in paths.items():
        write_digests(streamload.inspect(path))
        with recording(out, f"check/quantized/{layout}"):
            raise_if_broken()
            for mode, report in check_modes(str(path), QUANTIZED_MODES, dtype="bfloat16", **KV_CACHE).items():
                out[f"check/quantized/{layout}/{mode}"] = check_result(report)
        if layout in QUANTIZED_MOE_TP2:
            with recording(out, f"check/quantized/{layout}/tp2"):
                modes = check_modes(str(path), QUANTIZED_TP2_MODES, tp=2, dtype="bfloat16", **KV_CACHE)
                for mode, report in modes.items():
                    out[f"check/quantized/{layout}/tp2/{mode}"] = check_result(report)
        for fmt in ("safetensors", "streamload"):
            with recording(out, f"quantized/{layout}/{fmt}"):
                generated_and_reloaded(path, new[layout], fmt, f"quantized/{layout}/{fmt}", out, dtype="bfloat16")


QUANTIZED_MOE_CASES = [f"{layout}/{mode}" for layout in quantized_layouts.MOE_CONFIGS for mode in QUANTIZED_MODES] + [
    f"{layout}/tp2/{mode}" for layout in QUANTIZED_MOE_TP2 for mode in QUANTIZED_TP2_MODES
]
# vLLM's parameters: 2 layers' fused qkv and o (with their scales, packed shapes), each layer's experts
# fused into w13 and w2 (with their scales, W4A16's packed shapes; gpt-oss's biases), the router, norms
# (Qwen3's q and k norms; gpt-oss's sinks), embeddings and head.
QUANTIZED_MOE_PARAMETERS = {"moe-w4a16-group": 58, "moe-fp8-block": 46, "gpt-oss-mxfp4": 42}
# Tensors that go whole through load_weights: W4A16's `weight_shape` of fused qkv and of every expert's
# projections (24 + 6); gpt-oss's fused experts' bias and down blocks, narrowed by its load_weights.
QUANTIZED_MOE_WHOLE = {"moe-w4a16-group": 30, "moe-fp8-block": 0, "gpt-oss-mxfp4": 10}


@pytest.mark.parametrize("case", QUANTIZED_MOE_CASES)
def test_a_quantized_mixture_of_experts_equals_vllms_own_loader(engines: dict[str, Any], case: str) -> None:
    """Quantized mixtures of experts whose MoE kernels this CPU lacks, in their hub layouts: Qwen3-MoE in
    compressed-tensors W4A16 (pack-quantized, by group; each expert's projections stored one by one) and
    in FP8 with block scales (Qwen3-30B-A3B-FP8's, DeepSeek-V3's), gpt-oss in MXFP4 as OpenAI ships it
    (the experts fused, uint8 blocks and exponents). vLLM's own parameters and weight loaders; only the
    choice of the MoE kernel (and what it would do with the weights once loaded) is replaced, in the
    engines' process (tests/vllm_reference_kernels.py). Every parameter (packed experts, block scales,
    exponents, biases) equals vLLM's default loader's right after `load_weights`, in every mode and at
    TP=2 on its own and `cooperative`."""
    layout = case.partition("/")[0]
    result = engines[f"check/quantized/{case}"]
    _identical(result, case, QUANTIZED_MOE_PARAMETERS[layout], QUANTIZED_MOE_WHOLE[layout])
    if not case.endswith(("/whole", "/tp2/default", "/tp2/cooperative")):  # the later layers placed as layer 0's twins
        assert result["report"]["by_twin"] > 0, result["report"]


@pytest.mark.parametrize("layout", list(quantized_layouts.MOE_CONFIGS))
def test_a_quantized_mixture_of_experts_generates_as_vllms_own_loader(engines: dict[str, Any], layout: str) -> None:
    """The same mixtures of experts served on the reference kernels (each expert dequantized by its
    format's definition, the MoE in torch): greedy tokens, every parameter and what each CPU linear
    layer's packed copy computes equal vLLM's own loader's; then after an in-place reload of other
    weights (`reload_weights`: the experts' scales and packed values into the same storage) as after
    vLLM's own reload, which serves other tokens (a fresh engine's on those weights, checked by hand:
    the reference kernels leave the weights as loaded, where vLLM's CPU MoE repacks them)."""
    ours, theirs = (engines[f"quantized/{layout}/{k}"] for k in ("streamload", "safetensors"))
    assert len(ours["tokens"]) == 2 and all(len(t) == 12 for t in ours["tokens"])
    assert all(len(set(t)) > 2 for t in ours["tokens"]), ours["tokens"]  # not a NaN's token 0, repeated
    assert_same_weights(ours, theirs)
    assert_same_weights(ours["reloaded"], theirs["reloaded"])
    assert ours["reloaded"]["tokens"] != ours["tokens"]
    before, after = kept_params(ours), kept_params(ours["reloaded"])
    assert {n: p for n, (p, _) in after.items()} == {n: p for n, (p, _) in before.items()}


@scenario("quantized")
def refused_with_verify(root: Path, out: Timed) -> None:
    paths, _ = layouts(root)
    # With verify: a packed weight with a flipped byte is refused, naming the file and the tensor.
    flipped = root / "gptq-flipped"
    shutil.copytree(paths["gptq"], flipped)
    packed = streamload.inspect(flipped).tensors["model.layers.1.mlp.down_proj.qweight"]
    with open(packed.path, "r+b") as f:
        f.seek(packed.begin + 100)
        byte = f.read(1)[0]
        f.seek(packed.begin + 100)
        f.write(bytes([byte ^ 0x10]))
    verify = {"model_loader_extra_config": {"verify": True}, "dtype": "bfloat16"}
    out["quantized/gptq/verify-flipped"] = error_of(lambda: engine(flipped, "streamload", **verify))


def test_a_quantized_checkpoint_with_a_flipped_byte_is_refused_with_verify(engines: dict[str, Any]) -> None:
    """GPTQ with its digest file, a bit of a packed weight flipped: `verify` refuses the load, naming the
    file and the tensor, before the engine serves it."""
    error = engines["quantized/gptq/verify-flipped"]
    assert "gptq-flipped" in error and "model.layers.1.mlp.down_proj.qweight" in error, error


@scenario("quantized")
def generated_and_reloaded_engines(root: Path, out: Timed) -> None:
    paths, new = layouts(root)
    for layout in QUANTIZED_KERNELS:
        dtype = _dtype(layout)
        for fmt in ("safetensors", "streamload"):
            with recording(out, f"quantized/{layout}/{fmt}"):
                generated_and_reloaded(paths[layout], new[layout], fmt, f"quantized/{layout}/{fmt}", out, dtype=dtype)
        with recording(out, f"quantized/{layout}/new"):
            llm = engine(new[layout], "safetensors", dtype=dtype)  # a fresh engine on the reload's weights
            out[f"quantized/{layout}/new"] = {"tokens": tokens(llm), "state": state(llm)}
            close(llm)


def generated_and_reloaded(path: Path, new: Path, fmt: str, key: str, out: dict[str, Any], dtype: str) -> None:
    """Greedy tokens and every parameter of an engine on `path`, and again after an in-place reload of `new`."""
    llm = engine(path, fmt, dtype=dtype)
    run = {"tokens": tokens(llm), "state": state(llm)}
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new)})
    out[key] = run | {"reloaded": {"tokens": tokens(llm), "state": state(llm)}}
    close(llm)


@pytest.mark.parametrize("layout", QUANTIZED_KERNELS)
def test_a_quantized_checkpoint_generates_and_reloads_as_vllms_own_loader(engines: dict[str, Any], layout: str) -> None:
    """Where the kernels run here (oneDNN int8 by channel and tensor, FP8 by channel, W4A8; FP8 with
    block scales, W4A16, GPTQ and AWQ on the harness's reference kernels, tests/vllm_reference_kernels.py):
    greedy tokens and every parameter after post-processing as vLLM's own loader's; then an in-place
    reload of other weights (`reload_weights`) into the same storage, as vLLM's own reload: FP8 and the
    4-bit layouts (AWQ's converted after loading, reloaded in its own layout) then serve a fresh engine's
    tokens on those weights. vLLM 0.32's own in-place reload of the int8 layouts on the CPU
    serves other tokens (token 0, or one token repeated): streamload's reload leaves every parameter as
    vLLM's does; when the last assertion fails, vLLM has mended its reload."""
    ours, theirs, fresh = (engines[f"quantized/{layout}/{k}"] for k in ("streamload", "safetensors", "new"))
    assert len(ours["tokens"]) == 2 and all(len(t) == 12 for t in ours["tokens"])
    assert_same_weights(ours, theirs)
    assert fresh["tokens"] != ours["tokens"]
    if layout.startswith(("fp8-", "w4a16-", "gptq", "awq")):
        assert_same_weights(ours["reloaded"], theirs["reloaded"])
        assert ours["reloaded"]["tokens"] == fresh["tokens"]
    else:  # what either serves then is not the weights' (nor always the same): what the reload wrote is compared
        # (W4A8's kernel repacks `weight` into a new `weight_packed` after loading; after vLLM's reload that
        # copy differs from run to run, in vLLM's own engine too)
        repacked = "weight_packed" if layout == "w4a8" else None
        assert param_digests(ours["reloaded"], without=repacked) == param_digests(theirs["reloaded"], without=repacked)
        assert theirs["reloaded"]["tokens"] != fresh["tokens"]
    before, after = kept_params(ours), kept_params(ours["reloaded"])
    assert {n: p for n, (p, _) in after.items()} == {n: p for n, (p, _) in before.items()}


def test_the_reference_kernels_dequantize_as_the_layouts_quantize() -> None:
    """tests/vllm_reference_kernels.py reads back what testbed/quantized_layouts.py writes: W4A16's packed
    values exactly, FP8 blocks and MXFP4 within their formats' rounding (which the reference forward's
    tokens would not show)."""
    import torch

    from . import vllm_reference_kernels as reference

    w = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0)) * 0.2
    q, scale = quantized_layouts.symmetric(w[0], 4, quantized_layouts.GROUP)
    packed = quantized_layouts.pack_int4(q + 8, 1)
    assert torch.equal(reference._packed_int4(packed, scale), q * scale.repeat_interleave(quantized_layouts.GROUP, 1))
    fp8 = quantized_layouts.quantized("x.weight", w[0], "fp8-block")
    assert (reference._fp8_block(fp8["x.weight"], fp8["x.weight_scale_inv"]) - w[0]).norm() < 0.05 * w[0].norm()
    blocks, scales = quantized_layouts.mxfp4(w)
    assert (reference._mxfp4(blocks.flatten(-2), scales) - w).norm() < 0.15 * w.norm()
