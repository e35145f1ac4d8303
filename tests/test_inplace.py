"""`load_into(in_place=True)` and `iter(into=...)`: weights written into existing tensors, whose
storage (and address) never changes; values bit-exact against `safetensors.torch.load_file`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import streamload
from streamload.base.errors import StreamloadError, UnsupportedError

from .conftest import same_bits


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 16, dtype=dtype)
        self.layers = nn.ModuleList(nn.Linear(16, 16, dtype=dtype) for _ in range(3))
        self.head = nn.Linear(16, 300, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))


def _checkpoint(path: Path, dtype: torch.dtype = torch.float32, seed: int = 1) -> Path:
    torch.manual_seed(seed)
    state = {k: v.to(dtype) if v.is_floating_point() else v + seed for k, v in Tiny().state_dict().items()}
    state.pop("head.weight")  # saved once, as save_pretrained does with tied weights
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _addresses(model: nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_in_place_keeps_addresses_and_loads_exact_values(tmp_path: Path, reader: str) -> None:
    model = Tiny()
    before = _addresses(model)
    ckpt = _checkpoint(tmp_path / "a.safetensors")
    streamload.load_into(model, ckpt, in_place=True, reader=reader, ring_bytes=8192, slots=2)
    assert _addresses(model) == before
    assert model.head.weight is model.embed.weight
    reference = load_file(ckpt)
    for name, t in model.state_dict().items():
        if name != "head.weight":
            assert same_bits(t, reference[name]), name


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_in_place_converts_to_each_parameters_dtype(tmp_path: Path, reader: str) -> None:
    model = Tiny(dtype=torch.float32)
    model.layers[1].to(torch.float16)  # mixed: each parameter keeps its own dtype
    before = _addresses(model)
    ckpt = _checkpoint(tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    streamload.load_into(model, ckpt, in_place=True, reader=reader, ring_bytes=8192, slots=2)
    assert _addresses(model) == before
    reference = load_file(ckpt)
    assert model.layers[1].weight.dtype == torch.float16
    for name, t in model.state_dict().items():
        if name != "head.weight":
            assert torch.equal(t, reference[name].to(t.dtype)), name


def test_into_a_rank_slice_reads_only_its_bytes(tmp_path: Path) -> None:
    full = torch.randn(64, 32)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    dest = torch.zeros(32, 32)
    ptr = dest.data_ptr()
    spec = streamload.ShardSpec({"w": 0}, rank=1, world_size=2)
    with streamload.iter(tmp_path / "w.safetensors", device="cpu", reader="posix", shard=spec, into={"w": dest}) as s:
        ((_, got),) = list(s)
    assert got is dest and dest.data_ptr() == ptr
    assert torch.equal(dest, full[32:])
    assert s.stats.bytes_read == 32 * 32 * 4


@pytest.mark.parametrize("reader", ["mmap", "posix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_into_a_view_inside_a_larger_tensor(tmp_path: Path, reader: str, dtype: torch.dtype) -> None:
    """A fused parameter (q, k, v rows in one tensor): each checkpoint tensor lands at its own rows."""
    parts = {n: torch.randn(8, 4) for n in "qkv"}
    save_file(parts, str(tmp_path / "qkv.safetensors"))
    fused = torch.zeros(24, 4, dtype=dtype)
    into = {n: fused[8 * i : 8 * (i + 1)] for i, n in enumerate("qkv")}
    streamload.load(tmp_path / "qkv.safetensors", device="cpu", reader=reader, into=into, ring_bytes=8192, slots=2)
    assert torch.equal(fused, torch.cat([parts[n] for n in "qkv"]).to(dtype))


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_into_rank_parts_read_whole_or_sliced(tmp_path: Path, reader: str) -> None:
    """A column split (small strided blocks: read whole, then cut) and a row split, into views."""
    cols, rows = torch.randn(16, 8), torch.randn(8, 4)
    save_file({"cols": cols, "rows": rows}, str(tmp_path / "m.safetensors"))
    spec = streamload.ShardSpec({"cols": 1, "rows": 0}, rank=1, world_size=2)
    fused = torch.zeros(16 * 4 + 4 * 4)
    into = {"cols": fused[:64].view(16, 4), "rows": fused[64:].view(4, 4)}
    with streamload.iter(tmp_path / "m.safetensors", device="cpu", reader=reader, shard=spec, into=into) as s:
        assert {i.name: i.read_whole for i in s.plan.items} == {"cols": True, "rows": False}
        list(s)
    assert torch.equal(into["cols"], cols[:, 4:]) and torch.equal(into["rows"], rows[4:])


def test_an_explicit_slice_outside_the_tensor_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(8, 4)}, str(tmp_path / "m.safetensors"))
    from streamload.plan.shard import Slice

    for bad in (Slice(0, 6, 4), Slice(2, 0, 1), Slice(1, -1, 2)):
        spec = streamload.ShardSpec(lambda name, shape, bad=bad: bad, rank=0, world_size=2)
        with pytest.raises(ValueError, match="is not a slice of it"):
            streamload.load(tmp_path / "m.safetensors", device="cpu", shard=spec)


def test_into_a_non_contiguous_destination(tmp_path: Path) -> None:
    full = torch.randn(8, 6)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    base = torch.zeros(6, 8)
    dest = base.t()  # a transposed view: written through, not replaced
    for reader in ("posix", "mmap"):
        base.zero_()
        streamload.load(tmp_path / "w.safetensors", device="cpu", reader=reader, into={"w": dest})
        assert torch.equal(base.t(), full)


def test_in_place_errors_are_clear(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "a.safetensors")
    with pytest.raises(UnsupportedError, match="leave out dtype"):
        streamload.load_into(Tiny(), ckpt, in_place=True, dtype=torch.float16)
    with streamload.empty_weights():
        meta = Tiny()
    with pytest.raises(UnsupportedError, match="meta device"):
        streamload.load_into(meta, ckpt, in_place=True)
    small = Tiny()
    small.layers[0].weight = nn.Parameter(torch.zeros(8, 16))
    with pytest.raises(UnsupportedError, match=r"'layers\.0\.weight'.*shape \[8, 16\].*\[16, 16\]"):
        streamload.load_into(small, ckpt, in_place=True)
    ints = Tiny()
    ints.steps = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="'steps'.*int64 in place into a torch.float32"):
        streamload.load_into(ints, ckpt, in_place=True)
    extra = tmp_path / "extra.safetensors"
    save_file({**load_file(ckpt), "unknown.weight": torch.zeros(2)}, str(extra))
    with pytest.raises(StreamloadError, match="unexpected keys: 'unknown.weight'"):
        streamload.load_into(Tiny(), extra, in_place=True)


@pytest.mark.anyio
async def test_in_place_async(tmp_path: Path) -> None:
    model = Tiny()
    before = _addresses(model)
    ckpt = _checkpoint(tmp_path / "a.safetensors", seed=3)
    seen: list[str] = []
    await streamload.aload_into(model, ckpt, in_place=True, on_layer=lambda key, m: seen.append(key))
    assert _addresses(model) == before and seen == ["layers.0", "layers.1", "layers.2"]
    assert torch.equal(model.layers[2].bias, load_file(ckpt)["layers.2.bias"])


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_a_closed_stream_holds_none_of_the_destinations(tmp_path: Path, reader: str) -> None:
    """A closed stream keeps its plan and stats, but not the tensors `into=` named: they are the caller's."""
    import gc
    import weakref

    ckpt = _checkpoint(tmp_path / "a.safetensors")
    into = {k: torch.empty_like(v) for k, v in load_file(ckpt).items()}
    alive = [weakref.ref(t) for t in into.values()]
    stream = streamload.iter(ckpt, into=into, reader=reader, ring_bytes=8192, slots=2)
    with stream:
        handed = [name for name, _ in stream]
    assert len(handed) == len(into)
    del into
    gc.collect()
    assert [r for r in alive if r() is not None] == []
    assert {i.name for i in stream.plan.items} == set(load_file(ckpt)) and stream.stats.tensors_done == len(handed)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_fp8_weights_and_scales_in_place_at_a_ranks_rows(tmp_path: Path, reader: str) -> None:
    """An FP8 expert (float8_e4m3fn weight, float32 `weight_scale_inv`) written in place at rank 1's
    rows, as vLLM's parameters take them: the bytes exactly as stored."""
    from streamload import ShardSpec

    weight = (torch.randn(256, 64) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 1)
    save_file({"w.weight": weight, "w.weight_scale_inv": scale}, str(tmp_path / "m.safetensors"))
    into = {"w.weight": torch.zeros(128, 64, dtype=torch.float8_e4m3fn), "w.weight_scale_inv": torch.zeros(1, 1)}
    with streamload.iter(tmp_path / "m.safetensors", device="cpu", reader=reader, into=into,
                         shard=ShardSpec({"*": 0}, 1, 2)) as stream:  # fmt: skip
        got = dict(stream)
    assert got["w.weight"] is into["w.weight"] and same_bits(into["w.weight"], weight[128:])
    assert same_bits(into["w.weight_scale_inv"], scale[1:])


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_destinations_in_host_memory_are_read_straight_into(tmp_path: Path, cold: bool) -> None:
    """With the posix reader, a contiguous destination of the stored dtype gets its bytes from the
    read itself (`Item.read_in_place`): no slot holds them and nothing copies them. Tensors larger than a slot
    and than a request, small ones side by side, views inside one larger tensor, a transposed view
    and another dtype (those two through the slot): all bit-exact against load_file."""
    from streamload.commands.bench import evict

    g = torch.Generator().manual_seed(3)
    tensors = {"big": torch.randn(300, 70, generator=g), "t": torch.randn(8, 6, generator=g),
               **{f"e.{k}": torch.randn(5, 7, generator=g) for k in range(6)},
               "half": torch.randn(33, generator=g)}  # fmt: skip
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    fused = torch.zeros(6, 5, 7)
    into = {"big": torch.empty(300, 70), "t": torch.empty(6, 8).t(), "half": torch.empty(33, dtype=torch.float64),
            **{f"e.{k}": fused[k] for k in range(6)}}  # fmt: skip
    if cold:
        evict([str(path)])
    with streamload.iter(path, device="cpu", reader="posix", into=into, ring_bytes=64 << 10, slots=2,
                         chunk_bytes=16 << 10) as stream:  # fmt: skip
        landed = {i.name for i in stream.plan.items if i.read_in_place}
        got = dict(stream)
    assert landed == {"big", *(f"e.{k}" for k in range(6))}
    for name, t in tensors.items():
        assert got[name] is into[name] and torch.equal(got[name], t.to(into[name].dtype)), name
    assert torch.equal(fused, torch.stack([tensors[f"e.{k}"] for k in range(6)]))
    import hashlib

    digest = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    with streamload.iter(path, device="cpu", reader="posix", into=dict(into), verify=digest) as stream:
        assert not any(i.read_in_place for i in stream.plan.items)  # verify= hashes the bytes in the slot
        assert all(torch.equal(t, tensors[n].to(t.dtype)) for n, t in stream)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="this torch has no float8")
def test_scaled_values_are_never_cast_without_their_scale(tmp_path: Path) -> None:
    """A float8 or float4 value means something only with its block's or channel's scale: written
    into a tensor of another dtype (or a plain float into a float8 one) it would be wrong data. Refused
    before a byte is read, naming the file and tensor; plain floats still convert, float8 lands as is."""
    path = tmp_path / "q.safetensors"
    weight = (torch.randn(8, 4) * 4).to(torch.float8_e4m3fn)
    scales = torch.randint(100, 140, (2, 2), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    bias = torch.randn(8, dtype=torch.bfloat16)
    save_file({"weight": weight, "scales": scales, "bias": bias}, str(path))
    refused = {
        "weight": torch.zeros(8, 4, dtype=torch.bfloat16),
        "scales": torch.zeros(2, 2, dtype=torch.float32),
        "bias": torch.zeros(8, dtype=torch.float8_e4m3fn),
    }
    for name, dest in refused.items():
        held = "torch.float8_e8m0fnu" if name == "scales" else "torch.float8_e4m3fn"
        with pytest.raises(UnsupportedError, match=f"{path}: tensor '{name}': cannot load .* {held} holds scaled"):
            streamload.load(path, device="cpu", include=name, into={name: dest})
        assert not dest.float().any()  # untouched
    fp8, wide = torch.zeros(8, 4, dtype=torch.float8_e4m3fn), torch.zeros(8, dtype=torch.float32)
    streamload.load(path, device="cpu", include=["weight", "bias"], into={"weight": fp8, "bias": wide})
    assert same_bits(fp8, weight) and torch.equal(wide, bias.float())


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
def test_a_quantized_tensor_is_not_assigned_into_an_unquantized_model(tmp_path: Path) -> None:
    """`from_pretrained(strict=False)` / `load_into` of FP8 or packed-integer weights into a bf16 model
    used to assign them as they were (its forward then fails, or computes with unscaled values)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=128, torch_dtype="bfloat16")  # fmt: skip
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    for stored in (torch.float8_e4m3fn, torch.int32):  # FP8 weights; a packed int4 weight's int32 words
        quantized = dict(state)
        quantized[name] = state[name].float().to(stored)
        save_file(quantized, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        for strict in (True, False):
            with pytest.raises(StreamloadError, match=f"tensor '{name}' is {stored}, but LlamaForCausalLM's parameter"):
                streamload.from_pretrained(tmp_path, strict=strict)
    with streamload.empty_weights():
        module = nn.Linear(4, 8, dtype=torch.bfloat16)
    save_file(
        {"weight": torch.zeros(8, 4, dtype=torch.float8_e5m2), "bias": torch.zeros(8)}, str(tmp_path / "l.safetensors")
    )
    with pytest.raises(StreamloadError, match="'weight' is torch.float8_e5m2, but Linear's parameter 'weight' is"):
        streamload.load_into(module, tmp_path / "l.safetensors", device="cpu", strict=False)
    assert module.weight.is_meta  # nothing assigned
