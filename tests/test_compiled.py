"""vLLM's compiled artifacts published beside a checkpoint and installed where a node's cache lacks
them (`streamload compile-cache publish`, `integrations/vllm/compiled.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from streamload.integrations.vllm import compiled

from .servers import RangeServer


def _cache(root: Path) -> dict[str, bytes]:
    """A cache root shaped as vLLM's: an AOT-compiled model (Inductor's cache inside) and a graph cache."""
    files = {
        "torch_compile_cache/torch_aot_compile/aa11/inductor_cache/fxgraph/x.bin": b"\x01" * 1000,
        "torch_compile_cache/torch_aot_compile/aa11/rank_0_0/model": b"model",
        "torch_compile_cache/bb22/rank_0_0/backbone/computation_graph.py": b"graph",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_published_artifacts_install_where_the_cache_lacks_them(tmp_path: Path) -> None:
    files = _cache(tmp_path / "node-a")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "streamload", "compile-cache", "publish", str(model), "--cache-root",
                          str(tmp_path / "node-a")], capture_output=True, text=True, check=True)  # fmt: skip
    archive = Path(out.stdout.strip())
    assert archive.parent == model / compiled.FOLDER and archive.name == compiled.key_name(compiled.node_key()) + ".tar"
    assert json.loads((archive.parent / compiled.INDEX).read_text()) == {archive.stem: compiled.node_key()}

    empty = tmp_path / "node-b"
    assert "installed 2 compiled folder(s)" in compiled.install(str(model), empty)
    assert _tree(empty) == files  # nothing left beside them (the staging folder is gone)
    assert "here already" in compiled.install(str(model), empty)

    warm = tmp_path / "node-c"  # a node with its own build of one of them keeps it
    own = warm / "torch_compile_cache/bb22/rank_0_0/backbone/computation_graph.py"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"its own")
    assert "installed 1 compiled folder(s)" in compiled.install(str(model), warm)
    assert own.read_bytes() == b"its own" and _tree(warm).keys() == files.keys()

    server = RangeServer(tmp_path)  # over HTTP, as the weights are
    try:
        remote = tmp_path / "node-d"
        assert "installed 2" in compiled.install(f"{server.url}/model/", remote)
        assert _tree(remote) == files
    finally:
        server.close()


def test_artifacts_for_another_node_are_never_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cache(tmp_path / "node-a")
    model = tmp_path / "model"
    compiled.publish(model, tmp_path / "node-a")
    other = {**compiled.node_key(), "device": "cpu AVX512", "torch": "9.9"}
    monkeypatch.setattr(compiled, "node_key", lambda: other)
    said = compiled.install(str(model), tmp_path / "node-b")
    assert "no compiled artifacts published for this node" in said and "device 'cpu " in said and "torch '" in said
    assert not (tmp_path / "node-b" / compiled.CACHE).exists()
    assert "no compiled artifacts published beside" in compiled.install(str(tmp_path), tmp_path / "node-b")


def test_nothing_to_publish_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "streamload", "compile-cache", "publish", str(tmp_path), "--cache-root",
                          str(tmp_path / "empty")], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 1 and "no compiled artifacts to publish" in out.stderr and "Traceback" not in out.stderr


def test_vllms_model_inspections_are_installed_by_the_fetch_started_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM inspects a model's class (in a subprocess, before any load format runs) unless its cache
    root holds the answer: published with the compiled artifacts, the fetch started before vLLM's
    import puts it there; one the node has is kept."""
    from streamload import prefetch

    node = tmp_path / "node-a"
    _cache(node)
    (node / "modelinfos").mkdir()
    (node / "modelinfos" / "vllm-models-llama-LlamaForCausalLM.json").write_text('{"hash": "h", "modelinfo": {}}')
    (node / "modelinfos" / "vllm-models-qwen2-Qwen2ForCausalLM.json").write_text('{"hash": "q"}')
    model = tmp_path / "model"
    compiled.publish(model, node)
    cold = tmp_path / "node-b"
    (cold / "modelinfos").mkdir(parents=True)
    (cold / "modelinfos" / "vllm-models-qwen2-Qwen2ForCausalLM.json").write_text("its own")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cold))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    started = prefetch.ahead(str(model))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]
    assert sorted(p.name for p in (cold / "modelinfos").iterdir()) == [
        "vllm-models-llama-LlamaForCausalLM.json", "vllm-models-qwen2-Qwen2ForCausalLM.json"]  # fmt: skip
    assert (
        cold / "modelinfos" / "vllm-models-llama-LlamaForCausalLM.json"
    ).read_text() == '{"hash": "h", "modelinfo": {}}'
    assert (cold / "modelinfos" / "vllm-models-qwen2-Qwen2ForCausalLM.json").read_text() == "its own"
    assert [p.name for p in cold.iterdir()] == ["modelinfos"]  # no staging left


def test_the_fetch_started_first_stages_this_nodes_archive_before_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP, the fetch started before vLLM's import fetches the archives that may be this node's
    (not one for another vLLM or machine) before the weights; the worker's install then takes its own
    from there without a request (during the download a request waits behind the weights)."""
    import torch
    from safetensors.torch import save_file

    from streamload import prefetch

    key = compiled.node_key()  # the candidates are picked by the factors known without torch: the same
    assert prefetch._node_without_torch() == {f: key[f] for f in ("vllm", "torch", "python", "machine")}
    _cache(tmp_path / "node-a")
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(4)}, str(model / "model.safetensors"))
    mine = compiled.publish(model, tmp_path / "node-a")
    index = json.loads((model / compiled.FOLDER / compiled.INDEX).read_text())
    other = {**compiled.node_key(), "vllm": "0.0.1"}  # another node's archive, published beside it
    (model / compiled.FOLDER / "0123456789abcdef.tar").write_bytes(b"not for this node")
    index["0123456789abcdef"] = other
    (model / compiled.FOLDER / compiled.INDEX).write_text(json.dumps(index))
    server = RangeServer(tmp_path)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "node-b"))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    try:
        url = f"{server.url}/model/"
        started = prefetch.ahead(url, tmp_path / "cache")
        monkeypatch.delenv(prefetch.ENV, raising=False)
        assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]
        staged = prefetch.staged_compile_caches(started)
        assert staged is not None and sorted(p.name for p in staged.iterdir()) == [mine.name, "ready.json"]
        got = [path for method, path, _ in server.requests if method == "GET"]
        assert f"/model/{compiled.FOLDER}/{mine.name}" in got and "0123456789abcdef" not in " ".join(got)
        first_weight = next(k for k, p in enumerate(got) if p.endswith(".safetensors"))
        assert got.index(f"/model/{compiled.FOLDER}/{mine.name}") < first_weight
        before = len(server.requests)
        assert "installed 2" in compiled.install(url, tmp_path / "node-b", staged=staged)
        assert len(server.requests) == before  # from the staged copy
        assert _tree(tmp_path / "node-b" / compiled.CACHE) == _tree(tmp_path / "node-a" / compiled.CACHE)
    finally:
        server.close()
