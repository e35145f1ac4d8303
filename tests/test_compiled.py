"""vLLM's compiled artifacts published beside a checkpoint and installed where a node's cache lacks
them (`streamload compile-cache publish`, `integrations/vllm/startup/compiled.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from streamload.integrations.startup import pinned_digests as pins
from streamload.integrations.vllm.startup import compiled

from .cli_runs import cli, one_line_error, small_checkpoint
from .conftest import Mount
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
    pin, archive = out.stdout.split()[0], Path(out.stdout.split(maxsplit=1)[1].strip())
    assert pin == pins.digest(archive.read_bytes()) and f'{{"compile_cache": "{pin}"}}' in out.stderr
    pinned = frozenset({pin})
    assert archive.parent == model / compiled.FOLDER and archive.name == compiled.key_name(compiled.node_key()) + ".tar"
    assert json.loads((archive.parent / compiled.INDEX).read_text()) == {archive.stem: compiled.node_key()}

    empty = tmp_path / "node-b"
    assert "installed 2 compiled folder(s)" in compiled.install(str(model), pinned, empty)
    assert _tree(empty) == files  # nothing left beside them (the staging folder is gone)
    assert "here already" in compiled.install(str(model), pinned, empty)

    warm = tmp_path / "node-c"  # a node with its own build of one of them keeps it
    own = warm / "torch_compile_cache/bb22/rank_0_0/backbone/computation_graph.py"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"its own")
    assert "installed 1 compiled folder(s)" in compiled.install(str(model), pinned, warm)
    assert own.read_bytes() == b"its own" and _tree(warm).keys() == files.keys()

    server = RangeServer(tmp_path)  # over HTTP, as the weights are
    try:
        remote = tmp_path / "node-d"
        assert "installed 2" in compiled.install(f"{server.url}/model/", pinned, remote)
        assert _tree(remote) == files
    finally:
        server.close()


def test_artifacts_for_another_node_are_never_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cache(tmp_path / "node-a")
    model = tmp_path / "model"
    pinned = frozenset({pins.digest(compiled.publish(model, tmp_path / "node-a").read_bytes())})
    other = {**compiled.node_key(), "device": "cpu NO-SUCH-ISA", "torch": "9.9"}  # no real machine's
    monkeypatch.setattr(compiled, "node_key", lambda: other)
    said = compiled.install(str(model), pinned, tmp_path / "node-b")
    assert "no compiled artifacts published for this node" in said and "device 'cpu " in said and "torch '" in said
    assert not (tmp_path / "node-b" / compiled.CACHE).exists()
    assert "no compiled artifacts published beside" in compiled.install(str(tmp_path), pinned, tmp_path / "node-b")


def test_nothing_to_publish_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "streamload", "compile-cache", "publish", str(tmp_path), "--cache-root",
                          str(tmp_path / "empty")], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 1 and "no compiled artifacts to publish" in out.stderr and "Traceback" not in out.stderr


def test_compile_cache_publish_refuses_a_checkpoint_that_is_not_there(tmp_path: Path) -> None:
    cache_root = tmp_path / "vllm-cache"
    (cache_root / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache_root / "torch_compile_cache" / "abc" / "artifact").write_text("compiled")
    missing = tmp_path / "typo-model"
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    for target in (missing, a_file):
        run = cli("compile-cache", "publish", str(target), "--cache-root", str(cache_root), timeout=120)
        one_line_error(run, f"{target}: no such checkpoint directory")
    assert not missing.exists() and a_file.read_bytes() == b""


def test_compile_cache_publish_onto_a_read_only_checkpoint_is_one_line(mount: Mount, tmp_path: Path) -> None:
    cache_root = tmp_path / "vllm-cache"
    (cache_root / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache_root / "torch_compile_cache" / "abc" / "artifact").write_text("compiled")
    folder = mount(fill=small_checkpoint, read_only=True)
    run = cli("compile-cache", "publish", str(folder), "--cache-root", str(cache_root), timeout=120)
    line = one_line_error(run, str(folder))
    assert "Read-only file system" in line or "not writable" in line, line


def test_compile_cache_publish_on_a_full_disk_names_the_file_and_leaves_no_folder(mount: Mount, tmp_path: Path) -> None:
    cache_root = tmp_path / "vllm-cache"
    (cache_root / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache_root / "torch_compile_cache" / "abc" / "artifact").write_bytes(os.urandom(1 << 20))
    disk = mount(size=64 << 10)  # a checkpoint's folder with no room for a 1 MB archive
    run = cli("compile-cache", "publish", str(disk), "--cache-root", str(cache_root), timeout=120)
    one_line_error(run, "No space left on device", f"{disk}/streamload-compile-cache/")
    assert list(disk.iterdir()) == []  # neither a half-written archive nor the folder publish made


def test_publish_says_it_packs_every_model_compiled_under_the_cache_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's compiled folders are named by hashes that do not say which model they compiled, so publish
    packs a cache root's every one: it says so, and how to publish one model's alone."""
    from streamload.commands.cli import main

    model = tmp_path / "model"
    model.mkdir()
    shared = tmp_path / "shared"
    _cache(shared)
    assert main(["compile-cache", "publish", str(model), "--cache-root", str(shared)]) == 0
    said = capsys.readouterr().err
    assert "packed 2 compiled folders (bb22, torch_aot_compile/aa11)" in said and "VLLM_CACHE_ROOT" in said
    own = tmp_path / "own"
    (own / "torch_compile_cache" / "cc33").mkdir(parents=True)
    (own / "torch_compile_cache" / "cc33" / "artifact").write_bytes(b"compiled")
    assert main(["compile-cache", "publish", str(model), "--cache-root", str(own)]) == 0
    assert "packed" not in capsys.readouterr().err


def test_publish_packs_the_folders_an_engine_recorded_for_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine that loaded through streamload records, once compiled, which folder it compiled its model
    into (recorded.py): publish packs that model's folders alone, says which, and packs every folder
    again where no record names the model or the recorded folder is gone."""
    import tarfile

    from streamload.commands.cli import main
    from streamload.integrations.vllm.startup.recorded import record, recorded

    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    shared = tmp_path / "shared"
    _cache(shared)
    aot = shared / "torch_compile_cache/torch_aot_compile/aa11"
    record(str(model), str(aot), shared)  # as vLLM's worker names the folder it used
    record(str(other), str(shared / "torch_compile_cache/bb22/rank_0_0/backbone"), shared)
    assert recorded(model, shared) == ["torch_aot_compile/aa11"] and recorded(other, shared) == ["bb22"]
    for outside in (shared / "torch_compile_cache", tmp_path, shared / "torch_compile_cache/torch_aot_compile"):
        with pytest.raises(ValueError):
            record(str(model), str(outside), shared)  # not a compiled folder of the cache: never recorded
    (shared / "streamload-compiled" / "evil.json").write_text(json.dumps({"model": str(model.resolve()),
                                                                          "folder": str(tmp_path)}))  # fmt: skip
    assert recorded(model, shared) == ["torch_aot_compile/aa11"]  # an absolute folder is not the cache's
    assert main(["compile-cache", "publish", str(model), "--cache-root", str(shared)]) == 0
    said = capsys.readouterr()
    assert "recorded for" in said.err and "torch_aot_compile/aa11" in said.err and "bb22" not in said.err
    with tarfile.open(said.out.split(maxsplit=1)[1].strip()) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names == {n for n in _cache(tmp_path / "again") if "/aa11/" in n}

    (shared / "streamload-compiled" / "junk.json").write_text("{not json")  # skipped
    for folder in (aot, shared / "torch_compile_cache/bb22"):
        for f in sorted(folder.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        folder.rmdir()
    (shared / "torch_compile_cache/cc33").mkdir()
    (shared / "torch_compile_cache/dd44").mkdir()
    assert (
        recorded(model, shared) == []
        and main(["compile-cache", "publish", str(model), "--cache-root", str(shared)]) == 0
    )
    assert "packed 2 compiled folders (cc33, dd44): no engine recorded" in capsys.readouterr().err


def test_vllms_model_inspections_are_installed_by_the_fetch_started_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM inspects a model's class (in a subprocess, before any load format runs) unless its cache
    root holds the answer: published with the compiled artifacts, the fetch started before vLLM's
    import puts it there; one the node has is kept."""
    from streamload.integrations.startup import prefetch

    node = tmp_path / "node-a"
    _cache(node)
    (node / "modelinfos").mkdir()
    llama = '{"hash": "h", "modelinfo": {"architecture": "LlamaForCausalLM"}}'  # vLLM's inspection of that class
    (node / "modelinfos" / "vllm-models-llama-LlamaForCausalLM.json").write_text(llama)
    (node / "modelinfos" / "vllm-models-qwen2-Qwen2ForCausalLM.json").write_text('{"hash": "q"}')
    (node / "modelinfos" / "vllm-models-bert-BertModel.json").write_text('{"hash": "b"}')  # another model's
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (node / "modelinfos" / "vllm-models-llama-LlamaForCausalLM.json").chmod(0o600)  # as private here
    compiled.publish(model, node)
    import tarfile

    with tarfile.open(model / prefetch.MODEL_INFOS) as tar:  # this model's classes only, readable by all
        assert [(m.name, m.mode) for m in tar.getmembers()] == [
            ("modelinfos/vllm-models-llama-LlamaForCausalLM.json", 0o644)
        ]
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
    assert (cold / "modelinfos" / "vllm-models-llama-LlamaForCausalLM.json").read_text() == llama
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

    from streamload.integrations.startup import prefetch

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
        started = prefetch.ahead(url, tmp_path / "cache", pins.digest(mine.read_bytes()))
        monkeypatch.delenv(prefetch.ENV, raising=False)
        assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]
        staged = prefetch.staged_compile_caches(started)
        assert staged is not None and sorted(p.name for p in staged.iterdir()) == [mine.name, "ready.json"]
        got = [path for method, path, _ in server.requests if method == "GET"]
        assert f"/model/{compiled.FOLDER}/{mine.name}" in got and "0123456789abcdef" not in " ".join(got)
        first_weight = next(k for k, p in enumerate(got) if p.endswith(".safetensors"))
        assert got.index(f"/model/{compiled.FOLDER}/{mine.name}") < first_weight
        before = len(server.requests)
        pinned = frozenset({pins.digest(mine.read_bytes())})
        assert "installed 2" in compiled.install(url, pinned, tmp_path / "node-b", staged=staged)
        assert len(server.requests) == before  # from the staged copy
        assert _tree(tmp_path / "node-b" / compiled.CACHE) == _tree(tmp_path / "node-a" / compiled.CACHE)
    finally:
        server.close()


def _published(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint (one tensor) with a node's compiled artifacts published beside it: (model, archive)."""
    import torch
    from safetensors.torch import save_file

    _cache(tmp_path / "node-a")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.ones(4)}, str(model / "model.safetensors"))
    return model, compiled.publish(model, tmp_path / "node-a")


def test_a_published_archive_is_neither_fetched_nor_installed_without_the_opt_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled artifacts run as code: off unless an archive is pinned by its digest. Without it, the
    fetch started first asks the store for no archive, the loader installs none, and the option `true`
    alone is refused, saying why."""
    from vllm.config.load import LoadConfig

    from streamload.integrations.startup import prefetch
    from streamload.integrations.vllm import StreamloadModelLoader

    model, archive = _published(tmp_path)
    server = RangeServer(tmp_path)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "node-b"))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    try:
        url = f"{server.url}/model/"
        started = prefetch.ahead(url, tmp_path / "cache")
        monkeypatch.delenv(prefetch.ENV, raising=False)
        assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]
        assert prefetch.staged_compile_caches(started) is None
        loader = StreamloadModelLoader(LoadConfig(load_format="streamload", model_loader_extra_config={"source": url}))
        assert loader._compile_cache(SimpleNamespace(model=url)) is None
        got = [path for method, path, _ in server.requests if method == "GET"]
        assert any(p.endswith(".safetensors") for p in got) and f"/model/{compiled.FOLDER}/{archive.name}" not in got
        assert f"/model/{prefetch.MODEL_INFOS}" in got  # data, parsed as data (below): installed without a pin
    finally:
        server.close()
    assert not (tmp_path / "node-b" / compiled.CACHE).exists()
    with pytest.raises(ValueError, match="nothing pinned; pin the archives"):
        compiled.install(str(model), frozenset(), tmp_path / "node-b")
    for value, said in ((True, "True pins nothing"), ("sha256:beef", "'sha256:beef' is not a pinned digest")):
        with pytest.raises(ValueError, match=f"compile_cache: {said}.*runs code from the weights' store"):
            StreamloadModelLoader(
                LoadConfig(load_format="streamload", model_loader_extra_config={"compile_cache": value})
            )
    out = subprocess.run([sys.executable, "-m", "streamload", "serve", "--compile-cache", "yes", "--", "true"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 1 and "'yes' is not a pinned digest" in out.stderr and "Traceback" not in out.stderr


def test_a_tampered_archive_is_refused_with_both_digests_and_nothing_of_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's archive replaced after the user pinned the published one: refused before a byte of it
    is unpacked, by the worker's install (locally, over HTTP, through the loader) and by the fetch
    started first (which keeps no copy of it), naming the digest found and the one pinned."""
    import io
    import logging
    import tarfile

    from vllm.config.load import LoadConfig

    from streamload.integrations.startup import prefetch
    from streamload.integrations.vllm import StreamloadModelLoader

    model, archive = _published(tmp_path)
    pin = pins.digest(archive.read_bytes())
    buffer = io.BytesIO(archive.read_bytes())  # the published archive, with one more module in a compiled folder
    with tarfile.open(fileobj=buffer, mode="a") as tar:
        evil = b"import os; os.system('touch /tmp/owned')"
        info = tarfile.TarInfo("torch_compile_cache/cc33/rank_0_0/backbone/__init__.py")
        info.size = len(evil)
        tar.addfile(info, io.BytesIO(evil))
    archive.write_bytes(buffer.getvalue())
    tampered = pins.digest(archive.read_bytes())
    root = tmp_path / "node-b"
    with pytest.raises(pins.Refused, match=f"its digest is {tampered}, the pinned one is {pin}; nothing of it"):
        compiled.install(str(model), frozenset({pin}), root)
    assert not root.exists() or not any(root.rglob("*"))

    server = RangeServer(tmp_path)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    try:
        url = f"{server.url}/model/"
        with pytest.raises(pins.Refused, match=tampered):
            compiled.install(url, frozenset({pin}), root)
        started = prefetch.ahead(url, tmp_path / "cache", pin)
        monkeypatch.delenv(prefetch.ENV, raising=False)
        assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]
        staged = prefetch.staged_compile_caches(started)
        assert staged is not None and [p.name for p in staged.iterdir()] == ["ready.json"]  # fetched, not kept
        options = {"source": url, "compile_cache": pin, "prefetch": started}
        loader = StreamloadModelLoader(LoadConfig(load_format="streamload", model_loader_extra_config=options))
        logs = []
        handler = logging.Handler()
        handler.emit = logs.append  # type: ignore[method-assign]
        logging.getLogger("vllm.streamload").addHandler(handler)
        try:
            said = loader._compile_cache(SimpleNamespace(model=url)).result(timeout=60)
        finally:
            logging.getLogger("vllm.streamload").removeHandler(handler)
        assert f"its digest is {tampered}, the pinned one is {pin}" in said
        assert any(r.levelno == logging.ERROR and tampered in r.getMessage() for r in logs)
    finally:
        server.close()
    assert not root.exists() or not any(root.rglob("*")), list(root.rglob("*"))


def test_model_inspections_are_installed_only_as_the_plain_data_vllm_parses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM reads a model inspection with `json.load` into its `_ModelInfo` dataclass: no code. The fetch
    started first installs only files of that plain shape (a real one, as vLLM wrote it, loads through
    vLLM's own reader); an odd name, a nested object or a file that is not JSON is left out."""
    from vllm.model_executor.models.registry import _LazyRegisteredModel, _ModelInfo

    from streamload.integrations.startup import prefetch

    lazy = _LazyRegisteredModel("vllm.model_executor.models.llama", "LlamaForCausalLM")
    written = tmp_path / "node-a"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(written))
    # what vLLM's inspection finds (it runs this in a child interpreter of its own: ~10 s here for one call)
    inspected = _ModelInfo.from_model_cls(lazy.load_model_cls())
    lazy._save_modelinfo_to_cache(inspected, "the-hash")  # as vLLM writes it
    (written / "modelinfos" / "x-Evil.json").write_text('{"hash": "h", "modelinfo": {"a": {"__class__": "os"}}}')
    (written / "modelinfos" / "x-Pickle.json").write_bytes(b"\x80\x04K\x01.")
    (written / "modelinfos" / "x-Extra.json").write_text('{"hash": "h", "modelinfo": {}, "code": "print(1)"}')
    _cache(written)
    model = tmp_path / "model"
    model.mkdir()  # a config naming them all, so that publishing packs them: what installs is decided there
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM", "Evil", "Pickle", "Extra"]}')
    compiled.publish(model, written)
    cold = tmp_path / "node-b"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cold))
    assert prefetch.install_model_infos(str(model)) == 1
    assert [p.name for p in (cold / "modelinfos").iterdir()] == [lazy._get_cache_filename()]
    got = lazy._load_modelinfo_from_cache("the-hash")
    assert isinstance(got, _ModelInfo) and got.architecture == "LlamaForCausalLM"
    assert json.dumps(asdict(got)) == json.dumps(asdict(inspected))  # as vLLM wrote it (tuples as lists)
