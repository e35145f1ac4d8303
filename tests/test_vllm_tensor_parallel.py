"""Tensor parallelism on real vLLM engines (vLLM's CPU build): two ranks, a core each, loading and reloading
with vLLM's own loader and with streamload (verified, and cooperative): each rank reads its part, the tokens
and every rank's parameters are vLLM's own loader's. (The llama engine with verify also takes reloads that fail:
test_vllm_reload.py; overlap at TP=2: test_vllm_overlap.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from .test_vllm import kept_params, load_report
from .test_vllm_reload import failed_reloads
from .vllm_engines import Timed, close, engine, engine_processes, models, recording, scenario, state, tokens


@scenario("engines")
def tensor_parallel_engines(root: Path, out: Timed) -> None:
    paths = models(root)
    tp = {"safetensors": {}, "streamload": {"verify": True}, "streamload-cooperative": {"cooperative": True}}
    for name in ("llama", "qwen2-moe"):  # tensor parallel: two ranks, a core each
        for label, extra in tp.items():
            with recording(out, f"{name}/tp2/{label}"):
                tensor_parallel(root, paths, name, label, extra, out)


def tensor_parallel(root: Path, paths: dict[str, Path], name: str, label: str, extra: dict[str, Any],
                    out: dict[str, Any]) -> None:  # fmt: skip
    """Two ranks, a core each; a reload of llama, and reloads that fail."""
    fmt = label.partition("-")[0]
    llm = engine(paths[name], fmt, tensor_parallel_size=2, distributed_executor_backend="mp",
                 model_loader_extra_config=extra)  # fmt: skip
    out[f"{name}/tp2/{label}"] = {"tokens": tokens(llm), "state": state(llm)}
    if name == "llama":  # a reload reads each rank's part, as the load did (vLLM's own: the reference)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(paths["llama-new"])})
        out[f"{name}/tp2/{label}/reloaded"] = {"tokens": tokens(llm), "state": state(llm)}
        if label == "streamload":
            out[f"{name}/tp2/{label}/failed"] = failed_reloads(llm, root, paths)
    close(llm)
    if f"{name}/tp2/{label}/failed" in out:  # the engine whose reloads failed ends with its processes
        deadline = time.monotonic() + 30
        while engine_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        out[f"{name}/tp2/{label}/left"] = sorted(engine_processes())


@pytest.mark.parametrize("model", ["llama", "qwen2-moe"])
def test_tensor_parallel_ranks_read_their_part(engines: dict[str, Any], model: str) -> None:
    reference = engines[f"{model}/tp2/safetensors"]
    for label in ("streamload", "streamload-cooperative"):
        run = engines[f"{model}/tp2/{label}"]
        assert run["tokens"] == reference["tokens"], label
        for rank in (0, 1):
            digests = {n: d for n, (_, d) in kept_params(run, rank).items()}
            assert digests == {n: d for n, (_, d) in kept_params(reference, rank).items()}, (label, rank)
            report = load_report(run, rank)
            assert report["through_model"] == 0, report["why_whole"]
            assert report["bytes_read"] < 0.7 * report["bytes_total"], (label, rank, report)
            if label == "streamload-cooperative":  # what several ranks read whole, each reads a share of
                assert report["bytes_read"] <= report["bytes_fair"] * 1.05, (rank, report)


def test_a_tensor_parallel_reload_reads_each_ranks_part_and_serves_the_new_weights(engines: dict[str, Any]) -> None:
    fresh = engines["llama-new/safetensors"]  # a fresh engine on the new weights (TP=1: the same tokens)
    theirs = engines["llama/tp2/safetensors/reloaded"]  # vLLM's own loader reloading them at TP=2
    assert theirs["tokens"] == fresh["tokens"]
    for label in ("streamload", "streamload-cooperative"):
        before, after = engines[f"llama/tp2/{label}"], engines[f"llama/tp2/{label}/reloaded"]
        assert after["tokens"] == fresh["tokens"], label
        for rank in (0, 1):
            addresses = {n: p for n, (p, _) in kept_params(after, rank).items()}
            assert addresses == {n: p for n, (p, _) in kept_params(before, rank).items()}, (label, rank)
            digests = {n: d for n, (_, d) in kept_params(after, rank).items()}
            assert digests == {n: d for n, (_, d) in kept_params(theirs, rank).items()}, (label, rank)
            report = load_report(after, rank)  # the reload's: what the first load read, not everything
            assert report["through_model"] == 0, report["why_whole"]
            assert report["bytes_read"] < 0.7 * report["bytes_total"], (label, rank, report)
            if label == "streamload-cooperative":
                assert report["bytes_read"] <= report["bytes_fair"] * 1.05, (rank, report)
