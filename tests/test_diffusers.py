"""diffusers pipelines and models from their folders: `streamload.from_pretrained` against diffusers'
own `from_pretrained`, on small pipelines built from configs here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import streamload
from streamload.base.errors import StreamloadError
from testbed import diffusers_pipelines as made

from .conftest import assert_torch_layout, in_torch_layout, same_bits

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return made.stable_diffusion(tmp_path_factory.mktemp("sd"), variant="fp16")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return made.flux(tmp_path_factory.mktemp("flux"))


def components(pipe: Any) -> dict[str, torch.nn.Module]:
    return {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def placed(pipe: Any) -> Any:
    """diffusers' pipeline with its weights where torch would place them (`in_torch_layout`): diffusers
    keeps some as views of the file at its 8-byte alignment, and then its image depends on the file."""
    for module in components(pipe).values():
        in_torch_layout(module)
    return pipe


def assert_same_weights(ours: Any, theirs: Any) -> None:
    mine, reference = components(ours), components(theirs)
    assert mine.keys() == reference.keys()
    for module in mine.values():
        assert_torch_layout(module)
    for name, module in reference.items():
        assert type(mine[name]) is type(module), name
        want, got = module.state_dict(), mine[name].state_dict()
        assert got.keys() == want.keys(), name
        for key, t in want.items():
            assert same_bits(got[key], t), f"{name}.{key}"
            assert not got[key].is_meta, f"{name}.{key}"


def image(pipe: Any, **kwargs: Any) -> torch.Tensor:
    out = pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
               height=32, width=32, **kwargs)  # fmt: skip
    return out.images


def test_a_unet_pipeline_equals_diffusers(sd: Path) -> None:
    theirs = diffusers.StableDiffusionPipeline.from_pretrained(sd)
    layers: list[str] = []
    ours = streamload.from_pretrained(sd, device="cpu", on_layer=lambda key, module: layers.append(key))
    assert type(ours) is type(theirs)
    assert type(ours.scheduler) is type(theirs.scheduler) and ours.scheduler.config == theirs.scheduler.config
    assert ours.tokenizer("a cat").input_ids == theirs.tokenizer("a cat").input_ids
    assert ours.safety_checker is None and ours.feature_extractor is None
    assert_same_weights(ours, theirs)
    assert any(k.startswith("unet.") for k in layers) and any(k.startswith("text_encoder.") for k in layers)
    assert torch.equal(image(ours), image(placed(theirs)))


def test_a_transformer_pipeline_with_sharded_weights_equals_diffusers(flux: Path) -> None:
    theirs = diffusers.FluxPipeline.from_pretrained(flux)
    ours = streamload.from_pretrained(flux, device="cpu")
    assert type(ours) is type(theirs)
    assert_same_weights(ours, theirs)
    assert torch.equal(image(ours, max_sequence_length=16), image(placed(theirs), max_sequence_length=16))


def test_variant_and_dtype_per_component(sd: Path) -> None:
    theirs = diffusers.StableDiffusionPipeline.from_pretrained(sd, variant="fp16", torch_dtype=torch.float16)
    ours = streamload.from_pretrained(sd, device="cpu", variant="fp16", dtype=torch.float16)
    assert_same_weights(ours, theirs)
    assert ours.unet.dtype == torch.float16
    mixed = streamload.from_pretrained(sd, device="cpu", dtype={"unet": torch.bfloat16, "default": torch.float32})
    assert mixed.unet.dtype == torch.bfloat16 and mixed.vae.dtype == torch.float32
    assert mixed.text_encoder.dtype == torch.float32


def test_one_diffusers_model_folder(flux: Path) -> None:
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(flux / "transformer")
    ours = streamload.from_pretrained(flux / "transformer", device="cpu")
    assert type(ours) is type(theirs) and not ours.training
    want = theirs.state_dict()
    assert ours.state_dict().keys() == want.keys()
    assert all(same_bits(ours.state_dict()[k], t) for k, t in want.items())


@pytest.mark.parametrize(("folder", "key", "model"), [("transformer", "transformer_blockz", "FluxTransformer2DModel"),
                                                   ("", "text_encoderr", "the pipeline's components")])  # fmt: skip
def test_a_device_map_naming_no_module_is_refused_before_any_read(
    flux: Path, monkeypatch: pytest.MonkeyPatch, folder: str, key: str, model: str
) -> None:
    read: list[object] = []
    monkeypatch.setattr("streamload.integrations.diffusers.load_into", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=rf"device_map names '{key}', which is no module of {model} \(did you mean"):
        streamload.from_pretrained(flux / folder, device_map={key: "cpu"})
    assert not read


def test_what_streamload_cannot_build_is_named_before_any_read(sd: Path, tmp_path: Path) -> None:
    broken = tmp_path / "sd"
    shutil.copytree(sd, broken)
    index = json.loads((broken / "model_index.json").read_text())
    index["unet"] = ["diffusers", "NoSuchUNet"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(StreamloadError, match=r"component 'unet' \(diffusers.NoSuchUNet\)"):
        streamload.from_pretrained(broken, device="cpu")
    index["unet"] = ["torch", "nn.Module"]  # not a class streamload builds
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(StreamloadError, match="component 'unet'"):
        streamload.from_pretrained(broken, device="cpu")
    for f in (broken / "vae").glob("*.safetensors"):
        f.unlink()
    index["unet"] = ["diffusers", "UNet2DConditionModel"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(StreamloadError, match="vae: no safetensors weights"):
        streamload.from_pretrained(broken, device="cpu")
    with pytest.raises(StreamloadError, match="no such directory"):
        streamload.from_pretrained(tmp_path / "nonexistent", device="cpu")


def test_pipelines_from_object_storage(sd: Path, flux: Path) -> None:
    """Over HTTP, which cannot be listed (S3 takes the same path: small files by name, weights streamed)."""
    from .servers import RangeServer

    server = RangeServer(sd.parent.parent)
    try:
        url = f"{server.url}/{sd.parent.name}/{sd.name}"
        sd_fp16 = streamload.from_pretrained(url, device="cpu", variant="fp16", dtype=torch.float16)
        url = f"{server.url}/{flux.parent.name}/{flux.name}"
        flux_pipe = streamload.from_pretrained(url, device="cpu")  # the transformer's shards: from its index
        transformer = streamload.from_pretrained(f"{url}/transformer/", device="cpu")
    finally:
        server.close()
    theirs = diffusers.StableDiffusionPipeline.from_pretrained(sd, variant="fp16", torch_dtype=torch.float16)
    assert_same_weights(sd_fp16, theirs)
    assert sd_fp16.tokenizer("a cat").input_ids == theirs.tokenizer("a cat").input_ids
    theirs = diffusers.FluxPipeline.from_pretrained(flux)
    assert_same_weights(flux_pipe, theirs)
    assert torch.equal(image(flux_pipe, max_sequence_length=16), image(placed(theirs), max_sequence_length=16))
    assert type(transformer) is diffusers.FluxTransformer2DModel


def test_files_are_chosen_as_diffusers_chooses_them(flux: Path, tmp_path: Path) -> None:
    """A transformer folder holding the shards of one save with their index and the single file of
    another (a model saved twice with different shard sizes): diffusers reads what the index names,
    and so does streamload, locally and over HTTP."""
    from .servers import RangeServer

    folder = tmp_path / "flux"
    shutil.copytree(flux, folder)
    torch.manual_seed(1)  # other weights in the single file: reading it would give other values
    other = diffusers.FluxTransformer2DModel.from_config(
        diffusers.FluxTransformer2DModel.load_config(flux / "transformer")
    )
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "diffusion_pytorch_model.safetensors", folder / "transformer")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    theirs = diffusers.FluxPipeline.from_pretrained(folder)
    assert_same_weights(streamload.from_pretrained(folder, device="cpu"), theirs)
    alone = streamload.from_pretrained(folder / "transformer", device="cpu")
    assert all(same_bits(alone.state_dict()[k], t) for k, t in theirs.transformer.state_dict().items())
    server = RangeServer(tmp_path)
    try:
        assert_same_weights(streamload.from_pretrained(f"{server.url}/flux", device="cpu"), theirs)
    finally:
        server.close()


@pytest.fixture(scope="module")
def flux_bf16(flux: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("flux-bf16") / "flux"
    diffusers.FluxPipeline.from_pretrained(flux).to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_without_dtype_each_component_gets_its_librarys_dtype(flux_bf16: Path) -> None:
    """A bf16 pipeline: diffusers gives its own models float32 (the dtype they are built in) and the
    transformers encoders their config's bf16; streamload gives the same, weights bit for bit."""
    theirs = diffusers.FluxPipeline.from_pretrained(flux_bf16)
    ours = streamload.from_pretrained(flux_bf16, device="cpu")
    assert ours.transformer.dtype == ours.vae.dtype == torch.float32
    assert ours.text_encoder.dtype == ours.text_encoder_2.dtype == torch.bfloat16
    assert_same_weights(ours, theirs)
    alone = streamload.from_pretrained(flux_bf16 / "transformer", device="cpu")
    assert alone.dtype == diffusers.FluxTransformer2DModel.from_pretrained(flux_bf16 / "transformer").dtype


def test_modules_a_class_keeps_in_float32_stay_float32(flux_bf16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diffusers.FluxTransformer2DModel, "_keep_in_fp32_modules", ["time_text_embed", "norm_out"])
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(flux_bf16 / "transformer", torch_dtype=torch.bfloat16)
    ours = streamload.from_pretrained(flux_bf16 / "transformer", device="cpu", dtype=torch.bfloat16)
    want = theirs.state_dict()
    assert {t.dtype for k, t in want.items() if k.startswith("time_text_embed.")} == {torch.float32}
    assert {t.dtype for k, t in want.items() if k.startswith("transformer_blocks.")} == {torch.bfloat16}
    assert all(same_bits(ours.state_dict()[k], t) for k, t in want.items())
