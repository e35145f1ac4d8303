"""Layer-first loading: groups on real naming schemes, `layers()`, and `load_into`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import streamload
from streamload.plan.layer_keys import group_of

pytestmark = pytest.mark.anyio


def _keys(model_type: str, **config: object) -> list[str]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    return list(model.state_dict())


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize(
    ("model_type", "config", "layer_keys"),
    [
        ("llama", {**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 2}, [f"layers.{i}" for i in range(3)]),
        ("qwen2", {**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 2}, ["layers.0", "layers.1"]),
        ("mixtral", {**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4},
         ["layers.0", "layers.1"]),
        ("gpt2", {"n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": 100}, ["h.0", "h.1", "h.2"]),
        ("bert", {**SMALL, "num_hidden_layers": 2}, ["encoder.layer.0", "encoder.layer.1"]),
        ("t5", {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8, "vocab_size": 100},
         ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
    ],
)  # fmt: skip
def test_groups_of_real_architectures(model_type: str, config: dict, layer_keys: list[str]) -> None:
    keys = _keys(model_type, **config)
    groups = {group_of(k) for k in keys}
    assert groups - {"pre", "post"} == set(layer_keys)
    for k in keys:  # every tensor of a layer sits under its layer's prefix (MoE experts included)
        g = group_of(k)
        assert g in ("pre", "post") or k.startswith(g + ".")
    assert any(group_of(k) == "pre" for k in keys if "embed" in k or "wte" in k or "shared" in k)


def test_literal_names() -> None:
    assert group_of("blocks.11.attn.qkv.weight") == "blocks.11"  # DiT-style diffusion transformer
    assert group_of("model.layers.3.mlp.experts.17.w2.weight") == "model.layers.3"
    assert group_of("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert group_of("model.norm.weight") == "post" and group_of("lm_head.weight") == "post"
    assert group_of("model.embed_tokens.weight") == "pre" and group_of("transformer.wte.weight") == "pre"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)))) * self.scale


class Tiny(nn.Module):
    def __init__(self, d: int = 16, n: int = 6, vocab: int = 50) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied
        self.register_buffer("positions", torch.arange(8), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> tuple[Tiny, Path]:
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(0)
    ref = Tiny()
    for b in ref.layers:
        b.scale.uniform_()
    save_torch_state_dict(ref.state_dict(), tmp_path, max_shard_size=6000)  # drops the tied duplicate
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    return ref, tmp_path


def test_layers_complete_and_in_order_across_shards(tiny_checkpoint: tuple[Tiny, Path]) -> None:
    ref, path = tiny_checkpoint
    with streamload.layers(path, device="cpu", ring_bytes=16 * 1024, slots=2) as groups:
        seen = [(key, sorted(tensors)) for key, tensors in groups]
    keys = [k for k, _ in seen]
    assert keys == ["pre", *(f"layers.{i}" for i in range(6)), "post"]
    state = ref.state_dict()
    for key, names in seen:
        want = sorted(n for n in state if group_of(n) == key and n != "lm_head.weight")
        assert names == want, key


async def test_layers_async(tiny_checkpoint: tuple[Tiny, Path]) -> None:
    _, path = tiny_checkpoint
    async with streamload.layers(path, device="cpu") as groups:
        keys = [key async for key, _ in groups]
    assert keys[0] == "pre" and keys[-1] == "post" and len(keys) == 8


def test_custom_key(tiny_checkpoint: tuple[Tiny, Path]) -> None:
    _, path = tiny_checkpoint
    groups = dict(streamload.layers(path, device="cpu", key=lambda n: "even" if len(n) % 2 else "odd"))
    assert set(groups) == {"even", "odd"}


def test_load_into_meta_module_equals_load_state_dict(tiny_checkpoint: tuple[Tiny, Path]) -> None:
    ref, path = tiny_checkpoint
    with torch.device("meta"):
        model = Tiny()
    model.positions = torch.arange(8)  # non-persistent: not in the checkpoint, so set by hand
    fired: list[str] = []
    result = streamload.load_into(model, path, device="cpu", on_layer=lambda key, m: fired.append(key))
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert fired == [f"layers.{i}" for i in range(6)]
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    expected = Tiny()
    expected.load_state_dict(ref.state_dict(), assign=True)
    for (n1, a), (n2, b) in zip(model.state_dict().items(), expected.state_dict().items(), strict=True):
        assert n1 == n2 and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), n1
    assert isinstance(model.layers[0].up.weight, nn.Parameter) and model.layers[0].up.weight.requires_grad
    ids = torch.arange(8).reshape(2, 4)
    assert torch.equal(model(ids), ref(ids))


def test_on_layer_fires_before_the_last_bytes(
    tiny_checkpoint: tuple[Tiny, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = tiny_checkpoint
    streams = []
    real = streamload.nn.load_into.layers

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        streams.append(real(*args, **kwargs))
        return streams[-1]

    monkeypatch.setattr(streamload.nn.load_into, "layers", spy)
    progress = []
    model = Tiny()
    streamload.load_into(model, path, device="cpu", reader="posix", ring_bytes=8 * 1024, slots=2,
                         on_layer=lambda key, m: progress.append(streams[0].stats.bytes_read))  # fmt: skip
    total = streams[0].stats.bytes_total
    tensors = streamload.inspect(path).tensors.values()
    last_and_after = sum(t.nbytes for t in tensors if group_of(t.name) in ("layers.5", "post"))
    assert len(progress) == 6 and progress == sorted(progress)
    assert progress[0] < total - last_and_after  # layer 0 was handed over before the last layer's bytes were read


def test_strict_errors_name_missing_and_unexpected(tmp_path: Path) -> None:
    model = Tiny()
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    state["extra.weight"] = torch.ones(2)
    state.pop("lm_head.weight")
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(streamload.StreamloadError) as info:
        streamload.load_into(Tiny(), tmp_path, device="cpu")
    msg = str(info.value)
    assert "missing keys" in msg and "embed_tokens.weight" in msg and "unexpected keys" in msg and "extra.weight" in msg
    result = streamload.load_into(Tiny(), tmp_path, device="cpu", strict=False)
    assert result.unexpected_keys == ["extra.weight"]
    assert set(result.missing_keys) == {"embed_tokens.weight", "lm_head.weight"}


def test_load_into_refuses_a_tensor_of_another_shape_than_its_parameter_before_reading(tmp_path: Path) -> None:
    """torch's load_state_dict says "size mismatch"; a weight of another shape assigned under the
    module's declared one would load silently and fail (or compute garbage) later."""
    save_file({"lm_head.weight": torch.ones(64, 32), "lm_head.bias": torch.ones(64)}, str(tmp_path / "m.safetensors"))
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(30, 64)
    before = model.lm_head.weight.detach().clone()
    said = (r"loading into Module: shapes differ: .*m.safetensors: tensor 'lm_head.weight' is \[64, 32\], parameter "
            r"'lm_head.weight' is \[64, 30\]; nothing was read")  # fmt: skip
    for strict in (True, False):
        with pytest.raises(streamload.StreamloadError, match=said):
            streamload.load_into(model, tmp_path, include="lm_head*", strict=strict)
    assert torch.equal(model.lm_head.weight, before)


def test_meta_buffer_left_behind_is_an_error(tiny_checkpoint: tuple[Tiny, Path]) -> None:
    _, path = tiny_checkpoint
    with torch.device("meta"):
        model = Tiny()  # `positions` is non-persistent: the checkpoint cannot fill it
    with pytest.raises(streamload.StreamloadError, match="meta device.*positions"):
        streamload.load_into(model, path, device="cpu")


async def test_aload_into_with_async_hook(tiny_checkpoint: tuple[Tiny, Path]) -> None:
    ref, path = tiny_checkpoint
    model = Tiny()
    fired = []

    async def hook(key: str, m: nn.Module | None) -> None:
        fired.append((key, m is not None))

    await streamload.aload_into(model, path, device="cpu", on_layer=hook)
    assert fired == [(f"layers.{i}", True) for i in range(6)]
    assert torch.equal(model.layers[5].up.weight, ref.layers[5].up.weight)
