"""Converting while streaming (`streamload.plan.placement`, transformers 5's conversion rules): tiny models of
the types transformers converts, saved by transformers itself (experts one by one, multimodal models
under their older names) and in the model's own fused layout, loaded by `streamload.from_pretrained`:
the same names, every value bit-equal to transformers' own `from_pretrained`, the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import streamload
import streamload.integrations.transformers
from streamload.base.errors import UnsupportedError
from streamload.plan.placement import Conversion, Region

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping", reason="transformers 5 converts checkpoints while loading")

TEXT = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "image_size": 32, "patch_size": 8}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"moe_intermediate_size": 32, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, **TEXT},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, **TEXT},
    # MLA, a shared expert, a first dense layer, a router bias transformers keeps in float32
    "deepseek_v3": {**TEXT, "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4,
                    "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, **TEXT},
    "glm4_moe": {"moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "head_dim": 16, **TEXT},
    "llava": {"text_config": {"model_type": "llama", **TEXT},
              "vision_config": {"model_type": "clip_vision_model", **VISION}, "image_token_index": 255},
    "gemma3": {"text_config": {"model_type": "gemma3_text", "head_dim": 16, **TEXT},
               "vision_config": {"model_type": "siglip_vision_model", **VISION}, "mm_tokens_per_image": 4,
               "image_token_index": 255},
}  # fmt: skip
MULTIMODAL = {"llava", "gemma3"}


def build(model_type: str) -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    auto = transformers.AutoModelForImageTextToText if model_type in MULTIMODAL else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config)
    model.config.architectures = [type(model).__name__]
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(model type, transformers' own save: the checkpoint layout, the model's own fused layout)."""
    from safetensors.torch import save_model

    model = build(request.param)
    hub = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(hub)
    fused = tmp_path_factory.mktemp(request.param + "-fused")
    model.config.save_pretrained(fused)
    save_model(model, str(fused / "model.safetensors"), metadata={"format": "pt"})
    return request.param, hub, fused


def reference(model_type: str, path: Path) -> nn.Module:
    auto = transformers.AutoModelForImageTextToText if model_type in MULTIMODAL else transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.bfloat16).eval()


def assert_identical(got: nn.Module, ref: nn.Module) -> None:
    g, r = got.state_dict(), ref.state_dict()
    assert g.keys() == r.keys()
    for name, t in r.items():
        assert g[name].dtype == t.dtype and g[name].shape == t.shape, name
        assert torch.equal(g[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_from_pretrained_equals_transformers(saved: tuple[str, Path, Path], layout: str) -> None:
    model_type, hub, fused = saved
    path = hub if layout == "hub" else fused
    got = streamload.from_pretrained(path, device="cpu", dtype=torch.bfloat16)
    assert_identical(got, reference(model_type, path))


def test_experts_land_in_place_and_layers_are_whole_when_handed_out(tmp_path: Path) -> None:
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    ref = reference("qwen3_moe", tmp_path)
    seen: list[str] = []

    def on_layer(key: str, layer: nn.Module | None) -> None:
        assert layer is not None
        for name, p in layer.named_parameters():
            assert not p.is_meta and torch.equal(p, ref.get_parameter(f"{key}.{name}")), f"{key}.{name}"
        seen.append(key)

    got = streamload.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16, on_layer=on_layer)
    assert seen == ["model.layers.0", "model.layers.1"]
    experts = got.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.gate_up_proj.is_contiguous()
    assert_identical(got, ref)


def test_a_conversion_that_computes_is_refused_before_a_byte_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import conversion_mapping
    from transformers.core_model_loading import Interleave, WeightConverter

    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    interleaved = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [Interleave(dim=1)])
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda model, **kw: [interleaved])
    with pytest.raises(UnsupportedError, match=r"qwen3_moe: transformers converts .*down_proj.* with Interleave"):
        streamload.from_pretrained(tmp_path, device="cpu", reader="posix", threads=1)


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.empty(3, 4, 2, device="meta"))
        self.norm = nn.Parameter(torch.empty(2, device="meta"))


def test_load_into_with_a_conversion_of_ones_own(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    parts = {f"w.{e}": torch.randn(4, 2, generator=torch.Generator().manual_seed(e)) for e in range(3)}
    save_file({**parts, "ln": torch.ones(2)}, tmp_path / "m.safetensors")
    model = Fused()
    conv = Conversion.merge("experts", [f"w.{e}" for e in range(3)], (4, 2)) | Conversion.rename({"ln": "norm"})
    streamload.load_into(model, tmp_path / "m.safetensors", device="cpu", conversion=conv)
    assert torch.equal(model.experts, torch.stack([parts[f"w.{e}"] for e in range(3)]))
    assert torch.equal(model.norm, torch.ones(2))


def test_a_conversion_that_leaves_a_hole_or_mismatches_is_refused() -> None:
    conv = Conversion.merge("experts", ["w.0", "w.1"], (4, 2))
    with pytest.raises(UnsupportedError, match="'w.1' has shape \\[4, 3\\], its place in 'experts' \\[4, 2\\]"):
        conv.check({"w.0": (4, 2), "w.1": (4, 3)})
    holed = Conversion(dict(conv.regions), {"experts": (3, 4, 2)})
    with pytest.raises(UnsupportedError, match="filled by 2 tensors of 16 elements in all, not 24"):
        holed.check({"w.0": (4, 2), "w.1": (4, 2)})
    assert Region("t", (("narrow", 1, 2, 2), ("transpose", 0, 1, 0))).shape_in((3, 4)) == (2, 3)


def test_verify_checks_every_converted_byte(tmp_path: Path) -> None:
    import hashlib

    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    shard = tmp_path / "model.safetensors"
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    got = streamload.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16, verify={shard.name: digest})
    assert_identical(got, reference("qwen3_moe", tmp_path))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(streamload.IntegrityError, match="model.safetensors"):
        streamload.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16, verify={shard.name: digest})


def test_a_converted_checkpoint_reloads_in_place(tmp_path: Path) -> None:
    """A model's fused experts rewritten in place from a checkpoint stored expert by expert (a reload):
    every parameter keeps its storage, and ends equal to the new checkpoint's."""
    first, second = tmp_path / "first", tmp_path / "second"
    build("qwen3_moe").save_pretrained(first)
    model = streamload.from_pretrained(first, device="cpu", dtype=torch.bfloat16)
    newer = build("qwen3_moe")
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(1.0)
    newer.save_pretrained(second)
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    placed = streamload.integrations.transformers.conversion(
        model, {n: t.shape for n, t in streamload.inspect(second).tensors.items()}
    )
    streamload.load_into(model, second, in_place=True, conversion=placed)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == addresses
    assert_identical(model, reference("qwen3_moe", second))


def test_a_mixture_of_experts_over_http_converted_and_cached(tmp_path: Path) -> None:
    from .servers import RangeServer

    pytest.importorskip("obstore")
    local = tmp_path / "www" / "moe"
    build("qwen3_moe").save_pretrained(local, max_shard_size="200KB")
    ref = reference("qwen3_moe", local)
    server = RangeServer(tmp_path / "www")
    try:
        for _ in range(2):  # from the store, then from the cache it filled
            got = streamload.from_pretrained(f"{server.url}/moe/", device="cpu", dtype=torch.bfloat16,
                                             cache_dir=tmp_path / "cache")  # fmt: skip
            assert_identical(got, ref)
        assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == len(list(local.glob("*.safetensors")))
    finally:
        server.close()


def test_a_mixture_of_experts_from_a_hub_cache_verified_by_its_blob_names(tmp_path: Path) -> None:
    from .test_verify import hub_cache

    saved = tmp_path / "saved"
    build("qwen3_moe").save_pretrained(saved, max_shard_size="200KB")
    ref = reference("qwen3_moe", saved)
    snapshot = hub_cache(saved, tmp_path / "models--org--moe")
    for extra in saved.iterdir():  # config.json, the index: as the hub cache keeps them, beside the links
        extra.rename(snapshot / extra.name)
    got = streamload.from_pretrained(snapshot, device="cpu", dtype=torch.bfloat16, verify=True)
    assert_identical(got, ref)


TP = {"*.mlp.experts.gate_up_proj": 1, "*.mlp.experts.down_proj": 2, "*.self_attn.q_proj.weight": 0,
      "*.embed_tokens.weight": 1, "*.shared_experts.gate_proj.weight": 0}  # fmt: skip
EP = {"*.mlp.experts.*": 0}


@pytest.mark.parametrize("rules", [TP, EP], ids=["tensor", "expert"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_shard_rules_on_the_fused_layout_give_each_rank_its_part_of_every_target(
    tmp_path: Path, model_type: str, rules: dict[str, int]
) -> None:
    """A ShardSpec written against the model's own (fused) names gives each rank
    `tensor_split(transformers' tensor, world, dim)[rank]` from either layout: its experts alone for a
    split over experts, each piece's overlap with its part where the split crosses gate and up (3 ranks
    split 2I=64 into 22/21/21 rows, so rank 1's part holds the end of gate and the start of up)."""
    model = build(model_type)
    hub, fused = tmp_path / "hub", tmp_path / "fused"
    model.save_pretrained(hub)
    from safetensors.torch import save_model

    model.config.save_pretrained(fused)
    save_model(model, str(fused / "model.safetensors"), metadata={"format": "pt"})
    ref = reference(model_type, hub).state_dict()
    for path in (hub, fused):
        for rank in range(3):
            spec = streamload.ShardSpec(rules, rank, 3)
            got = streamload.from_pretrained(path, device="cpu", dtype=torch.bfloat16, shard=spec).state_dict()
            assert got.keys() == ref.keys()
            for name, t in ref.items():
                part = spec.resolved().slice(name, tuple(t.shape))
                want = t if part is None else t.narrow(part.dim, part.start, part.length)
                assert got[name].dtype == want.dtype and torch.equal(got[name], want), (path.name, rank, name)


def test_a_converted_mixture_of_experts_runs_offloaded(tmp_path: Path) -> None:
    """`offload` with a conversion: the experts of each streamed layer read into fused tensors made for
    the fetch, the first layer resident; logits and generated tokens those of transformers' model."""
    from streamload.integrations.transformers import conversion

    build("qwen3_moe").save_pretrained(tmp_path, max_shard_size="200KB")
    ref = reference("qwen3_moe", tmp_path)
    with streamload.empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16).eval()
    placed = conversion(model, {n: t.shape for n, t in streamload.inspect(tmp_path).tensors.items()})
    checkpoint = streamload.inspect(tmp_path)
    layer = sum(t.numel * 2 for n, t in checkpoint.tensors.items() if n.startswith("model.layers.1."))  # bf16
    outside = sum(t.numel * 2 for n, t in checkpoint.tensors.items() if not n.startswith("model.layers."))
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    with streamload.offload(model, tmp_path, device="cpu", budget_bytes=outside + layer * 7 // 2, conversion=placed,
                            dtype=torch.bfloat16, reader="posix") as off, torch.no_grad():  # fmt: skip
        assert off.stats.resident_blocks == 1 and off.stats.offloaded_blocks == 1
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        want = ref.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want)
        assert off.stats.fetches >= 4
    assert all(p.is_meta for p in model.model.layers[1].parameters())


def test_a_mixture_of_experts_from_s3_converted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .servers import s3_server, upload

    pytest.importorskip("moto")
    local = tmp_path / "moe"
    build("qwen3_moe").save_pretrained(local, max_shard_size="200KB")
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "moe/", local)
        got = streamload.from_pretrained("s3://models/moe/", device="cpu", dtype=torch.bfloat16)
    assert_identical(got, reference("qwen3_moe", local))
