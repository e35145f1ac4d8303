"""`"overlap": True` on real vLLM engines (vLLM's CPU build): vLLM profiles, compiles and warms up before the
weights are in, then loads them in place through its layerwise reload; eager and compiled, at one rank and at
two, against vLLM's own loader in the same mode (test_vllm.py's `loads` and test_vllm_tensor_parallel.py's
engines); refused, in one line, where it is not checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .conftest import have_vllm
from .test_vllm import assert_same_weights, load_config, load_report
from .vllm_engines import Timed, close, engine, error_of, models, recording, scenario, state, tokens

ROOT = Path(__file__).resolve().parent.parent


@scenario("engines")
def overlap_eager(root: Path, out: Timed) -> None:
    paths = models(root)
    with recording(out, "llama/overlap"):
        llm = engine(paths["llama"], "streamload", model_loader_extra_config={"overlap": True})
        out["llama/overlap"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)
    with recording(out, "llama/tp2/streamload-overlap"):  # two ranks, a core each
        tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
        llm = engine(paths["llama"], "streamload", model_loader_extra_config={"overlap": True}, **tp2)
        out["llama/tp2/streamload-overlap"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)


@scenario("engines")
def compiled_engines(root: Path, out: Timed) -> None:
    from streamload.integrations.vllm.startup import compiled, recorded

    paths = models(root)
    for fmt, extra in (("streamload", {"overlap": True}), ("safetensors", None)):  # streamload's compiles first
        with recording(out, f"llama/compiled/{fmt}", *(["llama/compiled/recorded"] if extra else [])):
            before = compiled.packed(compiled.cache_root())
            llm = engine(paths["llama"], fmt, enforce_eager=False, model_loader_extra_config=extra)
            out[f"llama/compiled/{fmt}"] = {"tokens": tokens(llm), "state": state(llm)}
            if fmt == "streamload":  # the folders its worker compiled into, as `compile-cache publish` reads them
                made = sorted(set(compiled.packed(compiled.cache_root())) - set(before))
                out["llama/compiled/recorded"] = {"recorded": recorded.recorded(paths["llama"]), "made": made,
                                                  "used": _compiled_folder(llm)}  # fmt: skip
            close(llm)


def _compiled_folder(llm: Any) -> str:
    """The folder vLLM's worker compiled into (`local_cache_dir`), under its compile cache."""
    folder = llm.collective_rpc(lambda self: self.vllm_config.compilation_config.local_cache_dir)[0]
    return str(folder)


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
        assert_same_weights(ours, theirs, rank)
        assert load_report(ours, rank)["bytes_read"] == load_report(ours, rank)["bytes_total"] > 0


@scenario("engines")
def overlap_refused_on_a_cpu_mixture_of_experts(root: Path, out: Timed) -> None:
    paths = models(root)
    overlap_moe = {"model_loader_extra_config": {"overlap": True}}
    out["qwen2-moe/overlap"] = error_of(lambda: engine(paths["qwen2-moe"], "streamload", **overlap_moe))


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
    loader = loader_class(load_config(model_loader_extra_config={"overlap": True, "prefetch": False}))
    with pytest.raises(UnsupportedError, match="'overlap' cannot be used: the model is not being loaded by a vLLM"):
        loader.load_weights(model, config)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    loader = loader_class(load_config(model_loader_extra_config={"overlap": True, "prefetch": False}))
    with pytest.raises(UnsupportedError, match=r"checked on vLLM 0\.32\.0 only, and this is vLLM 0\.33\.0"):
        loader.load_weights(model, config)
    assert torch.equal(model.weight, before)


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


@scenario("compiled-tp2")
def compiled_tensor_parallel(root: Path, out: Timed) -> None:
    """The slow scenario (`--compiled-tp2`, minutes here): overlap at TP=2 with vLLM's compilation,
    against vLLM's own loader compiled at TP=2."""
    paths = models(root)
    for fmt, extra in (("safetensors", None), ("streamload", {"overlap": True})):
        tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
        llm = engine(paths["llama"], fmt, enforce_eager=False, model_loader_extra_config=extra, **tp2)
        out[f"llama/tp2/compiled/{fmt}"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)


def test_overlap_compiled_at_tp2_serves_vllms_own_weights(slow_engines: dict[str, Any]) -> None:
    ours, theirs = slow_engines["llama/tp2/compiled/streamload"], slow_engines["llama/tp2/compiled/safetensors"]
    for rank in (0, 1):
        assert_same_weights(ours, theirs, rank)
