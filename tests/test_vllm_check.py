"""`streamload vllm-check` (`streamload.integrations.vllm.check`): its comparison, on tensors described as the
engines' ranks describe them; a path that is not a model folder named before vLLM is imported; every parameter
of many architectures equal to vLLM's default loader's, on real engines (vLLM's CPU build), from the API and
from the command line; and a whole check on a CPU where none of vLLM's CPU variables is set."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload.integrations.vllm.check import Report, _describe, compare

from .cli_runs import cli, one_line_error
from .vllm_engines import (
    KV_CACHE,
    SMALL,
    SUITE_ENVIRONMENT,
    Timed,
    check_result,
    mla_backend,
    raise_if_broken,
    recording,
    scenario,
)


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


@scenario("engines")
def architectures(root: Path, out: Timed) -> None:
    """Every architecture of `make_checked_models` checked, one from the command line; Qwen3-MoE's layout
    with 128 experts a layer; expert parallelism and a cooperative MLA + MoE load at TP=2."""
    checked_models = make_checked_models(root)
    for name, path in checked_models.items():
        with recording(out, f"check/{name}"):
            out[f"check/{name}"] = checked(path)
    with recording(out, "check/cli"):
        out["check/cli"] = command(["vllm-check", str(checked_models["gpt2"]), "--dtype", "float32"])
    with recording(out, "check/qwen3-moe"):
        out["check/qwen3-moe"] = checked(many_experts(root))
    # Expert parallelism (vLLM's CPU build loads it, but its forward pass crashes: only the weights are
    # compared); the dry run, forced, learns which experts this rank keeps.
    ep = {"enable_expert_parallel": True, "model_loader_extra_config": {"direct": True}}
    with recording(out, "check/qwen3-moe/ep2"):
        out["check/qwen3-moe/ep2"] = checked(many_experts(root, layers=2), tp=2, **ep)
    cooperative = {"model_loader_extra_config": {"cooperative": True}}
    with recording(out, "check/deepseek-v2/tp2"):
        out["check/deepseek-v2/tp2"] = checked(root / "deepseek-v2", tp=2, **cooperative)


def make_checked_models(root: Path) -> dict[str, Path]:
    """Models whose every parameter `streamload.integrations.vllm.check` compares with vLLM's own loader: the two that
    were silently wrong (BGE-M3's .pt secondary heads, an untied BERT masked-LM decoder vLLM ties when it
    is not among the names its loader gets), an MLA + MoE model, fused checkpoint tensors, Conv1D, Gemma-2's
    norms and tied embeddings, gpt-oss's fused experts with biases and sinks."""
    import transformers

    def bge_m3() -> Any:
        config = transformers.XLMRobertaConfig(**{**SMALL, "max_position_embeddings": 260}, pad_token_id=1)
        return transformers.XLMRobertaModel(config, add_pooling_layer=False)

    deepseek = transformers.DeepseekV2Config(**{**SMALL, "intermediate_size": 128}, q_lora_rank=64, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        tie_word_embeddings=False)  # fmt: skip
    gpt_oss = transformers.GptOssConfig(**{**SMALL, "intermediate_size": 128}, num_local_experts=4,
        num_experts_per_tok=2, head_dim=32, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    builds: dict[str, Callable[[], Any]] = {
        "bert-mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**SMALL, tie_word_embeddings=False)),
        "bge-m3": bge_m3,
        "deepseek-v2": lambda: transformers.DeepseekV2ForCausalLM(deepseek),
        "phi3": lambda: transformers.Phi3ForCausalLM(
            transformers.Phi3Config(**SMALL, tie_word_embeddings=False, pad_token_id=0)
        ),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=300, n_positions=256)
        ),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=32)),
        "gpt-oss": lambda: transformers.GptOssForCausalLM(gpt_oss),
    }
    paths = {}
    for seed, (name, build) in enumerate(builds.items(), start=10):
        torch.manual_seed(seed)
        model = build()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        paths[name] = root / name
        model.save_pretrained(paths[name], max_shard_size="300KB")
    bge = paths["bge-m3"]  # vLLM's BgeM3EmbeddingModel: its sparse and colbert heads in .pt files beside
    config = json.loads((bge / "config.json").read_text())
    config.update(architectures=["BgeM3EmbeddingModel"], position_embedding_type="absolute")
    (bge / "config.json").write_text(json.dumps(config))
    torch.save({"weight": torch.randn(1, 128), "bias": torch.randn(1)}, bge / "sparse_linear.pt")
    torch.save({"weight": torch.randn(128, 128) * 0.1, "bias": torch.randn(128)}, bge / "colbert_linear.pt")
    _word_tokenizer().save_pretrained(bge)  # its pooling tasks need one
    return paths


def _word_tokenizer() -> Any:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(4, 300)} | {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "<s>",
                "sep_token": "</s>", "mask_token": "<unk>"}  # fmt: skip
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)


def checked(path: Path, tp: int = 1, **engine: Any) -> dict[str, Any]:
    from streamload.integrations.vllm.check import check

    raise_if_broken()
    return check_result(check(str(path), tp=tp, **{"dtype": "float32", **KV_CACHE, **mla_backend(path), **engine}))


def command(argv: list[str]) -> dict[str, Any]:
    """`streamload ARGV` in this process: its exit status and what it printed."""
    import contextlib
    import io

    from streamload.commands.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(argv)
    return {"status": status, "printed": printed.getvalue()}


def many_experts(root: Path, layers: int = 12) -> Path:
    """Qwen3-30B-A3B's checkpoint layout (128 experts a layer, the hub's names) in 12 of its 48 layers:
    4,719 tensors, as `bench/moe.py` writes it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe", Path(__file__).parent.parent / "bench" / "moe.py")
    assert spec is not None and spec.loader is not None
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    moe.make(root / f"qwen3-moe-{layers}", "qwen3-moe", layers=layers)
    return root / f"qwen3-moe-{layers}"


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


@scenario("fresh")
def vllm_check_without_cpu_variables(root: Path, out: Timed) -> None:
    """`streamload vllm-check` of a tiny Llama, in a process of its own where none of vLLM's VLLM_CPU_*
    variables is set."""
    import transformers

    folder = root / "vllm-check-bare"
    folder.mkdir()
    key = "vllm-check/without-cpu-variables"
    with recording(out, key):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                          max_position_embeddings=256)  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(folder / "tiny")
        env = {k: v for k, v in SUITE_ENVIRONMENT.items() if not k.startswith("VLLM_CPU_")}
        run = cli("vllm-check", str(folder / "tiny"), env=env, timeout=400)
        out[key] = {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}


def test_vllm_check_runs_on_a_cpu_without_vllms_cpu_variables(engines: dict[str, Any]) -> None:
    """vLLM's CPU worker reserves 92% of the machine's memory for its KV cache unless told otherwise, and
    refuses to start where less is free: the check sizes the cache for its 256 tokens itself."""
    run = engines["vllm-check/without-cpu-variables"]
    assert run["returncode"] == 0, run["stderr"][-3000:]
    agree = r"streamload and vLLM's default loader agree: 1 rank, \d+ tensors each, byte for byte$"
    assert re.search(agree, run["stdout"]), run["stdout"]
