"""vLLM's model inspections published beside a checkpoint (`prefetch.install_model_infos`) are
installed only for the checkpoint's own model classes: a file `modelinfos/<module>-<Class>.json`
whose class is one its config.json names in `architectures` and whose inspection says it is of that
class. The archive is unpinned and every later vLLM engine on the node trusts what is installed (a
class said to be a pooling model is served as one), so a GPT-2 checkpoint's archive must not decide
what `LlamaForCausalLM` is for the node."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamload.integrations.startup import prefetch

LLAMA = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
GPT2 = "vllm-model_executor-models-gpt2-GPT2LMHeadModel.json"


def _info(architecture: str, pooling: bool = False) -> bytes:
    """An inspection shaped as vLLM writes one (`_LazyRegisteredModel._save_modelinfo_to_cache`)."""
    fields = {"architecture": architecture, "is_text_generation_model": not pooling, "is_pooling_model": pooling,
              "supports_pp": True, "supported_video_pruning_methods": []}  # fmt: skip
    return json.dumps({"hash": "h", "modelinfo": fields}, indent=2).encode()


def _tar(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"modelinfos/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _publish(model: Path, members: dict[str, bytes], config: bytes | None) -> None:
    (model / prefetch.COMPILE_CACHE).mkdir(parents=True, exist_ok=True)
    (model / prefetch.MODEL_INFOS).write_bytes(_tar(members))
    if config is not None:
        (model / "config.json").write_bytes(config)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """vLLM's cache root for this node (not made yet)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    return tmp_path / "vllm" / "modelinfos"


def _installed(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in cache.iterdir()} if cache.is_dir() else {}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "streamload" and r.levelno >= logging.WARNING]


GPT2_CONFIG = json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}).encode()


def test_an_archive_installs_no_inspection_of_a_class_the_checkpoint_does_not_name(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPT-2 checkpoint's archive holding an inspection of `LlamaForCausalLM` that calls it a pooling
    model: only GPT-2's own installs; one warning names the archive and what it skipped."""
    model = tmp_path / "gpt2"
    _publish(model, {LLAMA: _info("LlamaForCausalLM", pooling=True), GPT2: _info("GPT2LMHeadModel")}, GPT2_CONFIG)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(model)) == 1
    assert _installed(cache) == {GPT2: _info("GPT2LMHeadModel")}
    said = _warnings(caplog)
    assert len(said) == 1 and f"{prefetch.MODEL_INFOS} beside {model}: 1 member(s) skipped" in said[0], said
    assert "GPT2LMHeadModel" in said[0], said  # the classes the checkpoint names


@pytest.mark.parametrize("claims", ["LlamaForCausalLM", "", None])
def test_an_inspection_must_be_of_the_class_its_file_is_named_for(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture, claims: str | None
) -> None:
    """The file is named for the checkpoint's class but the inspection inside is of another class (or
    names none): vLLM would take it as GPT-2's, so it is skipped."""
    model = tmp_path / "gpt2"
    raw = _info("GPT2LMHeadModel", pooling=True)
    info = json.loads(raw)
    if claims is None:
        del info["modelinfo"]["architecture"]
    else:
        info["modelinfo"]["architecture"] = claims
    _publish(model, {GPT2: json.dumps(info).encode()}, GPT2_CONFIG)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(model)) == 0
    assert _installed(cache) == {}
    assert len(_warnings(caplog)) == 1 and "1 member(s) skipped" in _warnings(caplog)[0], _warnings(caplog)


@pytest.mark.parametrize(
    "config", [None, b"not json", b'["GPT2LMHeadModel"]', b'{"architectures": "GPT2LMHeadModel"}', b"{}"]
)
def test_without_a_config_naming_its_classes_nothing_installs(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture, config: bytes | None
) -> None:
    """No config.json beside the weights, or one that names no list of classes: which classes are the
    checkpoint's is not known, so nothing installs (one warning), and the call returns."""
    model = tmp_path / "gpt2"
    _publish(model, {GPT2: _info("GPT2LMHeadModel")}, config)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(model)) == 0
    assert _installed(cache) == {}
    assert len(_warnings(caplog)) == 1 and "1 member(s) skipped" in _warnings(caplog)[0], _warnings(caplog)


@pytest.fixture
def http(tmp_path: Path) -> Iterator[str]:
    pytest.importorskip("obstore")
    from .servers import RangeServer

    (tmp_path / "served").mkdir()
    server = RangeServer(tmp_path / "served")
    try:
        yield server.url
    finally:
        server.close()


def test_the_config_is_read_through_the_storage_of_the_archive(
    tmp_path: Path, cache: Path, http: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Weights on an HTTP server: the config beside them there says which classes are the checkpoint's
    (a config.json on this host, beside nothing, has no say)."""
    served = tmp_path / "served" / "gpt2"
    _publish(served, {LLAMA: _info("LlamaForCausalLM", pooling=True), GPT2: _info("GPT2LMHeadModel")}, GPT2_CONFIG)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(f"{http}/gpt2/") == 1
    assert _installed(cache) == {GPT2: _info("GPT2LMHeadModel")}
    assert len(_warnings(caplog)) == 1 and "1 member(s) skipped" in _warnings(caplog)[0], _warnings(caplog)
