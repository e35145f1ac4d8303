"""Layers that load alike: one layer's dry run places its twins' tensors exactly where a dry run of
every tensor would, and a layer that differs in any setting its loaders may read is no twin."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import streamload
from streamload.integrations.vllm.placement import twins
from streamload.integrations.vllm.placement.dryrun import Learned, dry_run, replay

Pairs = Iterable[tuple[str, torch.Tensor]]
EXPERTS, HIDDEN, FFN = 4, 8, 6


class Experts(nn.Module):
    """vLLM's fused experts in small: gate and up stacked in w13, one loader for every expert; an
    expert map (which experts this rank keeps, and where) like expert parallelism's."""

    def __init__(self, rank: int = 0, world: int = 1, keep: list[int] | None = None) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        kept = list(range(EXPERTS)) if keep is None else keep
        self.expert_map = torch.full((EXPERTS,), -1)
        self.expert_map[kept] = torch.arange(len(kept))
        part = FFN // world
        self.w13 = nn.Parameter(torch.zeros(len(kept), 2 * part, HIDDEN), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(len(kept), HIDDEN, part), requires_grad=False)
        for p in (self.w13, self.w2):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, t: torch.Tensor, expert: int, which: str) -> None:
        local = int(self.expert_map[expert])  # a value: the loader reads the map (not a stand-in's)
        if local < 0:
            return
        part = FFN // self.world
        if which == "down":
            param.data[local].copy_(t.narrow(1, self.rank * part, part))
        else:
            at = 0 if which == "gate" else part
            param.data[local].narrow(0, at, part).copy_(t.narrow(0, self.rank * part, part))


class Layer(nn.Module):
    def __init__(self, index: int, prefix: str, **experts: object) -> None:
        super().__init__()
        self.layer_idx, self.prefix = index, prefix
        self.norm = nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)
        self.experts = Experts(**experts)  # type: ignore[arg-type]


class Model(nn.Module):
    def __init__(self, layers: int = 4, **experts: object) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(16, HIDDEN), requires_grad=False)
        self.layers = nn.ModuleList(Layer(i, f"model.layers.{i}", **experts) for i in range(layers))

    def load_weights(self, pairs: Pairs) -> set[str]:
        loaded = set()
        for name, t in pairs:
            loaded.add(self.load_one(name, t))
        return loaded

    def load_one(self, name: str, t: torch.Tensor) -> str:
        if name == "model.embed.weight":
            self.embed.data.copy_(t)
            return "embed"
        parts = name.split(".")
        layer = self.layers[int(parts[2])]
        if parts[3] == "norm":
            layer.norm.data.copy_(t)
            return f"layers.{parts[2]}.norm"
        # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
        expert, which = int(parts[5]), parts[6].removesuffix("_proj")
        param = layer.experts.w2 if which == "down" else layer.experts.w13
        param.weight_loader(param, t, expert, which)
        return f"layers.{parts[2]}.experts.{'w2' if which == 'down' else 'w13'}"


def checkpoint(layers: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed.weight": torch.randn(16, HIDDEN, generator=g)}
    for i in range(layers):
        out[f"model.layers.{i}.norm.weight"] = torch.randn(HIDDEN, generator=g)
        for e in range(EXPERTS):
            p = f"model.layers.{i}.mlp.experts.{e}."
            out[p + "gate_proj.weight"] = torch.randn(FFN, HIDDEN, generator=g)
            out[p + "up_proj.weight"] = torch.randn(FFN, HIDDEN, generator=g)
            out[p + "down_proj.weight"] = torch.randn(HIDDEN, FFN, generator=g)
    return out


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}


def targets(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def learn(model: Model, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[Learned, twins.Spread]:
    layers = twins.sample(shapes)
    learned, _ = dry_run(model.load_weights, {n: shapes[n] for n in layers.sample}, targets(model))
    return learned, twins.spread(learned, layers, model)


def key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_twins_are_placed_as_a_dry_run_of_every_tensor_places_them(rank: int, world: int) -> None:
    tensors = checkpoint()
    shapes = shapes_of(tensors)
    model = Model(rank=rank, world=world)
    layers = twins.sample(shapes)
    assert layers.members == {0: [1, 2, 3]}
    assert all(n == "model.embed.weight" or n.startswith("model.layers.0.") for n in layers.sample)

    learned, spread = learn(model, shapes)
    full, _ = dry_run(model.load_weights, shapes, targets(model))  # every tensor, the slow way
    assert learned.copies.keys() == full.copies.keys() == shapes.keys()
    for name, copy in full.copies.items():
        assert key(learned.copies[name].dest) == key(copy.dest) and learned.copies[name].part == copy.part, name
    assert learned.trusted == {n for n in shapes if n.split(".")[2:3] in (["1"], ["2"], ["3"])}
    assert spread.loaded({"embed", "layers.0.norm", "layers.0.experts.w13"}) >= {"layers.3.experts.w13"}


def test_a_stream_into_the_twins_places_equals_the_model_loading_every_tensor(tmp_path: Path) -> None:
    """End to end at rank 1 of 2: the dry-run layer's tensors through the watched real call, the twins'
    straight into place by the stream; every parameter equals the model's own load of whole tensors."""
    tensors = checkpoint()
    save_file(tensors, tmp_path / "model.safetensors")
    shapes = shapes_of(load_file(tmp_path / "model.safetensors"))
    reference, model = Model(rank=1, world=2), Model(rank=1, world=2)
    reference.load_weights(tensors.items())

    learned, spread = learn(model, shapes)
    fed = []
    rule = {n: c.part for n, c in learned.copies.items()}
    shard = streamload.ShardSpec(lambda n, shape: rule.get(n), 1, 2)
    into = {n: c.dest for n, c in learned.copies.items()}
    with replay(learned, shapes, targets(model)) as run:

        def feed() -> Pairs:  # the stream's own writes into place are not the loader's: not watched
            with run.paused():
                stream = iter(streamload.iter(tmp_path / "model.safetensors", shard=shard, into=into))
            while True:
                with run.paused():
                    name = next((name for name, _ in stream if name not in learned.trusted), None)
                if name is None:
                    return
                fed.append(name)
                yield name, run.stand_in(name)

        loaded = spread.loaded(model.load_weights(feed()))
    assert sorted(fed) == sorted(twins.sample(shapes).sample)  # the twins' tensors only went into place
    assert loaded == reference.load_weights(tensors.items())
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name


def test_a_layer_whose_settings_differ_is_no_twin() -> None:
    """Expert parallelism with per-layer placements (layer 2 keeps other experts), a layer that keeps
    another setting: their tensors go whole to the model's loaders; the others are twins."""
    shapes = shapes_of(checkpoint())
    model = Model(keep=[0, 2])
    model.layers[2].experts.expert_map = torch.tensor([-1, 0, -1, 1])  # another placement, same shapes
    model.layers[3].experts.world = 3  # a setting its loader reads
    learned, spread = learn(model, shapes)
    assert spread.unlike == [2, 3]
    assert {n for n in learned.whole} == {n for n in shapes if n.startswith(("model.layers.2.", "model.layers.3."))}
    assert learned.whole["model.layers.2.norm.weight"] == "a layer unlike the dry-run ones"
    # Layer 1 is layer 0's twin: experts 1 and 3 unused there as in layer 0, never read.
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in learned.unused & learned.trusted
    assert learned.copies["model.layers.1.mlp.experts.2.up_proj.weight"].dest.data_ptr() == (
        model.layers[1].experts.w13[1, FFN:].data_ptr()
    )


def test_own_names_and_indices_are_the_only_differences_allowed() -> None:
    a, b = Layer(3, "model.layers.3"), Layer(4, "model.layers.4")
    own = twins._Own(("model.layers.3", "model.layers.4"), (3, 4))
    assert twins._alike(a, b, own, {})
    b.prefix = "model.layers.40"  # not its own name
    assert not twins._alike(a, b, own, {})
    b.prefix, b.layer_idx = "model.layers.4", 5  # not its own index
    assert not twins._alike(a, b, own, {})
    b.layer_idx = 4
    b.experts.w13.weight_loader = partial(b.experts.weight_loader)  # another kind of loader
    assert not twins._alike(a, b, own, {})


def test_layers_of_another_kind_are_dry_run_each_and_a_renumbering_model_gets_no_twins() -> None:
    tensors = checkpoint(layers=3)
    tensors["model.layers.2.norm.weight"] = torch.zeros(HIDDEN, dtype=torch.float16)  # another signature
    layers = twins.sample(shapes_of(tensors))
    assert layers.members == {0: [1]}
    assert any(n.startswith("model.layers.2.") for n in layers.sample)

    class Renumbered(Model):  # checkpoint layer i lands in model layer i + 1
        def load_weights(self, pairs: Pairs) -> set[str]:
            def moved(name: str) -> str:
                if not name.startswith("model.layers."):
                    return name
                parts = name.split(".")
                return ".".join([*parts[:2], str(int(parts[2]) + 1), *parts[3:]])

            return super().load_weights((moved(n), t) for n, t in pairs)

    shapes = shapes_of(checkpoint(layers=3))
    learned, spread = learn(Renumbered(layers=4), shapes)
    assert spread.unlike == [1, 2] and not learned.trusted


def test_a_dry_run_layer_that_places_nothing_or_a_shared_parameter_makes_no_twins() -> None:
    shapes = shapes_of(checkpoint())

    class Skipping(Model):  # pipeline parallelism in small: layer 0 is another rank's, its tensors passed by
        def load_weights(self, pairs: Pairs) -> set[str]:
            return super().load_weights((n, t) for n, t in pairs if not n.startswith("model.layers.0."))

    learned, spread = learn(Skipping(), shapes)
    assert spread.unlike == [1, 2, 3] and not learned.trusted  # the model's layers 1-3 load whole

    shared = Model()
    shared.layers[1].norm = shared.layers[0].norm  # one parameter in two layers: not layer 1's own
    learned, spread = learn(shared, shapes)
    assert spread.unlike == [1]
    assert learned.whole.keys() == {n for n in shapes if n.startswith("model.layers.1.")}


def test_a_view_of_another_dtype_or_a_zero_one_setting_makes_no_twins() -> None:
    shapes = shapes_of(checkpoint())
    shapes |= {f"model.layers.{i}.bits.weight": ((HIDDEN,), torch.int32) for i in range(4)}

    class Bits(Model):  # each layer keeps a float32 parameter written as int32 bits
        def __init__(self) -> None:
            super().__init__()
            for layer in self.layers:
                layer.bits = nn.Parameter(torch.zeros(HIDDEN), requires_grad=False)

        def load_weights(self, pairs: Pairs) -> set[str]:
            rest = []
            for name, t in pairs:
                if name.endswith("bits.weight"):
                    self.layers[int(name.split(".")[2])].bits.data.view(torch.int32).copy_(t)
                else:
                    rest.append((name, t))
            return super().load_weights(rest)

    learned, spread = learn(Bits(), shapes)
    assert spread.unlike == [1, 2, 3] and not learned.trusted

    a, b = Layer(0, "model.layers.0"), Layer(1, "model.layers.1")
    own = twins._Own(("model.layers.0", "model.layers.1"), (0, 1))
    a.sliding, b.sliding = 0, 1  # a 0/1 switch equal to the indices is a setting, not their index
    assert not twins._alike(a, b, own, {})


class ByIndex(Model):
    """A `load_weights` that narrows a layer by its index, its modules alike: the odd layers' (or only
    the last layer's) gate and up projections are kept from the other end of the tensor."""

    def __init__(self, odd: bool = True, **experts: object) -> None:
        super().__init__(**experts)
        self.odd = odd

    def load_one(self, name: str, t: torch.Tensor) -> str:
        parts = name.split(".")
        special = len(parts) > 6 and (int(parts[2]) % 2 if self.odd else int(parts[2]) == len(self.layers) - 1)
        if not special or parts[6] == "down_proj":
            return super().load_one(name, t)
        experts = self.layers[int(parts[2])].experts
        part, local = FFN // experts.world, int(experts.expert_map[int(parts[5])])
        at, start = (0 if parts[6] == "gate_proj" else part), (experts.world - 1 - experts.rank) * part
        experts.w13.data[local].narrow(0, at, part).copy_(t.narrow(0, start, part))
        return f"layers.{parts[2]}.experts.w13"


@pytest.mark.parametrize("odd", [True, False], ids=["odd-layers", "last-layer"])
def test_layers_a_load_weights_narrows_by_index_load_as_vllms_own_loader_loads_them(
    tmp_path: Path, odd: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Modules alike, loading not: the twin rule is checked by a dry run of the first and last twins,
    found wrong, and not used; every parameter equals what the model's own `load_weights` makes of the
    whole tensors (what vLLM's default loader gives it), bit for bit. Rank 1 of 2, layers 0-4."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config.load import LoadConfig

    from streamload.integrations.vllm import StreamloadModelLoader, last_load

    tensors = checkpoint(layers=5)
    save_file(tensors, tmp_path / "model.safetensors")
    reference, model = ByIndex(odd, layers=5, rank=1, world=2), ByIndex(odd, layers=5, rank=1, world=2)
    reference.load_weights(tensors.items())  # vLLM's DefaultModelLoader: load_weights given every whole tensor

    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader = StreamloadModelLoader(LoadConfig(load_format="streamload", model_loader_extra_config={"direct": True}))
    with caplog.at_level("WARNING", logger="vllm.streamload"):
        loader.load_weights(model, config)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    assert last_load.by_twin == 0 and not last_load.diverged, last_load
    checked = "layer 1" if odd else "layer 4"
    assert f"loads {checked} unlike layer 0, although their modules are alike" in caplog.text, caplog.text
    assert f"'model.layers.{checked[-1]}.mlp.experts.0.gate_proj.weight': [0:3] of dim 0" in caplog.text, caplog.text

    same = Model(layers=5, rank=1, world=2)  # loading alike: the checked twins agree, all four are twins
    learned, spread = learn(same, shapes_of(tensors))
    assert spread.unlike == [] and {int(n.split(".")[2]) for n in learned.trusted} == {1, 2, 3, 4}
