"""What a checkpoint's own files say never chooses what runs or where a byte is written: the
pipeline index of a diffusers folder names libraries and component folders, and both are data."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import streamload
from streamload.base.errors import UnsupportedError
from testbed import diffusers_pipelines as made

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return made.stable_diffusion(tmp_path_factory.mktemp("sd"))


def test_a_library_named_by_the_index_is_never_imported(
    sd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """diffusers imports whatever module a component's entry names; streamload takes classes from
    diffusers (and its pipelines' modules) and transformers only, and refuses the rest by name."""
    marker = tmp_path / "imported"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "planted_by_the_store.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Model: pass\n")
    monkeypatch.syspath_prepend(str(modules))
    folder = tmp_path / "sd"
    shutil.copytree(sd, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["planted"] = ["planted_by_the_store", "Model"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedError, match=r"component 'planted' \(planted_by_the_store\.Model\).*diffusers and"):
        streamload.from_pretrained(folder, device="cpu")
    assert not marker.exists()
    assert "planted_by_the_store" not in sys.modules


@pytest.mark.parametrize("component", ["../escape", "..", "a/../../escape", "/abs"])
def test_component_names_never_choose_where_a_file_is_written(
    sd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, component: str
) -> None:
    """Over HTTP the pipeline's small files are copied into a scratch folder by component name: a
    name that is not a plain folder name is refused before anything is fetched for it, and nothing
    lands outside the scratch folder (which is removed)."""
    from .servers import RangeServer

    served = tmp_path / "served"
    shutil.copytree(sd, served / "sd")
    index = json.loads((served / "sd" / "model_index.json").read_text())
    index[component] = ["diffusers", "AutoencoderKL"]
    (served / "sd" / "model_index.json").write_text(json.dumps(index))
    for folder in (served / "escape", served / "abs"):  # what the planted names reach, served
        folder.mkdir()
        shutil.copy(served / "sd" / "vae" / "config.json", folder)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    server = RangeServer(served)
    try:
        with pytest.raises(UnsupportedError, match="is not a plain folder name"):
            streamload.from_pretrained(f"{server.url}/sd", device="cpu")
    finally:
        server.close()
    assert list(scratch.iterdir()) == []
    assert not Path("/escape").exists() and not Path("/abs/config.json").exists()


def test_a_config_naming_its_own_code_is_refused_and_the_code_never_runs(tmp_path: Path) -> None:
    """A transformers config whose `auto_map` names Python files beside the weights (remote code):
    streamload builds only the installed library's classes, so the files are never imported."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\nfrom transformers import LlamaConfig as PlantedConfig\n"
    (tmp_path / "m" / "configuration_planted.py").write_text(code)
    (tmp_path / "m" / "modeling_planted.py").write_text(code)
    settings = json.loads((tmp_path / "m" / "config.json").read_text())
    settings["auto_map"] = {"AutoConfig": "configuration_planted.PlantedConfig",
                            "AutoModelForCausalLM": "modeling_planted.PlantedConfig"}  # fmt: skip
    settings["model_type"] = "planted"
    (tmp_path / "m" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(UnsupportedError, match="config.json"):
        streamload.from_pretrained(tmp_path / "m", device="cpu")
    assert not marker.exists()
