"""Layers that load alike: one layer's dry run places the tensors of its twins.

A mixture of experts has tens of thousands of tensors, and a dry run costs ~0.3 ms for each (vLLM's
per-expert loaders, watched); but a model's layers of one kind are built by the same code and loaded
alike. So the dry run sees the tensors outside the layers and one layer of each kind only (`sample`);
a later layer whose checkpoint tensors (names after the layer's, shapes, dtypes) and model layer
(everything but its own name and index) are a dry-run layer's is its twin (`spread`): its tensors go
where that layer's went, at its own parameters. Twins are neither dry-run nor given to the real
`load_weights`; a layer unlike every dry-run one (pipeline parallel's missing layers, a per-layer
expert placement) goes whole through `load_weights`.

Alike modules do not prove alike loading: `load_weights` may treat a layer by its index (odd layers
narrowed otherwise, the last one special). So the first and the last twin of each dry-run layer get a
dry run of their own (`_checked`), which must place each tensor exactly as the rule does; where one
does not, no layer of that kind is a twin.
"""

from __future__ import annotations

import functools
import logging
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from streamload.integrations.vllm.placement.dryrun import Copy, Learned, Shapes, dry_run
from streamload.integrations.vllm.placement.recorder import span, view_key
from streamload.plan.layer_keys import layer_of

log = logging.getLogger("vllm.streamload")
_Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


@dataclass
class Layers:
    """A checkpoint's tensors by layer: the names a dry run sees (`sample`) and, for each dry-run
    layer, the later layers of the same checkpoint signature (`members`)."""

    sample: list[str]
    members: dict[int, list[int]] = field(default_factory=dict)  # dry-run layer -> its candidate twins
    names: dict[int, list[str]] = field(default_factory=dict)  # layer -> its tensor names, in order
    prefix: dict[int, str] = field(default_factory=dict)  # layer -> its checkpoint prefix ("model.layers.3")
    shapes: Shapes = field(default_factory=dict)  # every tensor's, in the order load_weights gets them


def sample(shapes: Shapes) -> Layers:
    """The tensors to dry-run: all outside the layers, and every layer whose tensors are unlike an
    earlier layer's; the others are that layer's candidate twins."""
    layers = Layers([], shapes=shapes)
    for name in shapes:
        layer = layer_of(name)
        if layer is None:
            continue
        if layers.prefix.setdefault(layer.index, layer.name) != layer.name:  # two stacks share an index
            return Layers(list(shapes), shapes=shapes)
        layers.names.setdefault(layer.index, []).append(name)
    first: dict[_Signature, int] = {}
    for index, names in layers.names.items():
        cut = len(layers.prefix[index])
        signature = tuple(sorted((n[cut:], *shapes[n]) for n in names))  # (a layer may span two shards)
        if (dry := first.setdefault(signature, index)) != index:
            layers.members.setdefault(dry, []).append(index)
    twins = {i for members in layers.members.values() for i in members}
    layers.sample = [n for n in shapes if (layer := layer_of(n)) is None or layer.index not in twins]
    return layers


@dataclass
class Spread:
    """What the twins of the dry-run layers add to a dry run's `Learned` (changed in place)."""

    unlike: list[int] = field(default_factory=list)  # candidate twins found unlike: whole, to load_weights
    moves: dict[str, list[str]] = field(default_factory=dict)  # dry-run layer's module -> its twins'

    def loaded(self, names: Iterable[str]) -> set[str]:
        """`load_weights`' answer (the parameters it loaded) with the twins' parameters added."""
        out = set(names)
        for name in list(out):
            for dry, twins in self.moves.items():
                if name.startswith(dry + "."):
                    out.update(twin + name[len(dry) :] for twin in twins)
        return out


def spread(learned: Learned, layers: Layers, model: nn.Module) -> Spread:
    """Extend `learned` (a dry run of `layers.sample`) to each candidate twin that is one: its
    tensors placed, unused or whole as the dry-run layer's are; the placed and unused ones are
    `learned.trusted` (the real call is not given them)."""
    named = dict(model.named_buffers(remove_duplicate=False))
    named.update(model.named_parameters(remove_duplicate=False))
    owners: dict[int, str] = {}  # each parameter's and buffer's storage -> its name
    for name, t in named.items():
        if not t.is_meta:
            owners.setdefault(t.untyped_storage().data_ptr(), name)
    moves = {dry: _placement(learned, layers, dry, owners) for dry in layers.members}
    twins: dict[int, dict[str, Copy] | None] = {}  # candidate -> the dry-run layer's copies at its parameters
    for dry, members in layers.members.items():
        move = moves[dry]
        twins.update((i, move.to(i, layers, model, named) if move is not None else None) for i in members)
    refused = _checked(learned, layers, model, twins)
    result = Spread()
    for dry, members in layers.members.items():
        move = moves[dry]
        for index in members:
            twin = twins[index]
            names = layers.names[index]
            if move is None or twin is None or dry in refused:  # not a twin: read whole, loaded by its own loaders
                result.unlike.append(index)
                learned.whole.update(dict.fromkeys(names, refused.get(dry, "a layer unlike the dry-run ones")))
                continue
            for name in names:
                mine = layers.prefix[dry] + name[len(layers.prefix[index]) :]
                if mine in learned.copies:
                    learned.copies[name] = twin[mine]
                    learned.trusted.add(name)
                elif mine in learned.unused:
                    learned.unused.add(name)
                    learned.trusted.add(name)
                else:
                    learned.whole[name] = learned.whole.get(mine, "as its layer's twin")
            for module in move.modules:
                result.moves.setdefault(module, []).append(_renamed(module, layers.prefix[index], move.index))
    return result


def _checked(
    learned: Learned, layers: Layers, model: nn.Module, twins: Mapping[int, dict[str, Copy] | None]
) -> dict[int, str]:
    """The dry-run layers whose twins are not to be trusted, and why: the first and the last twin of
    each are dry-run, all in one call, and each of their tensors must land where the rule puts it."""
    checks: dict[int, list[int]] = {}
    for dry, members in layers.members.items():
        alike = [i for i in members if twins[i] is not None]  # (the others load whole anyway)
        if alike:
            checks[dry] = sorted({alike[0], alike[-1]})
    wanted = {n for indices in checks.values() for i in indices for n in layers.names[i]}
    if not wanted:
        return {}
    wanted_shapes = {n: s for n, s in layers.shapes.items() if n in wanted}  # in the real call's order
    try:
        seen, _ = dry_run(model.load_weights, wanted_shapes, [*model.parameters(), *model.buffers()])
    except Exception as exc:  # no dry run to check against: nothing is trusted
        why = f"the dry run of layers {sorted({i for v in checks.values() for i in v})} failed ({exc})"
        log.warning("streamload: %s; their kinds' layers load whole through load_weights", why)
        return dict.fromkeys(checks, why)
    refused = {}
    for dry, indices in checks.items():
        for index in indices:
            twin = twins[index]
            assert twin is not None
            if why := _unlike(learned, seen, layers, dry, index, twin):
                refused[dry] = f"layer {index} does not load as layer {dry}'s twin ({why})"
                log.warning(
                    "streamload: %s.load_weights loads layer %d unlike layer %d, although their modules are "
                    "alike: %s; the %d layers like it load whole through load_weights",
                    type(model).__name__, index, dry, why, len(layers.members[dry]),
                )  # fmt: skip
                break
    return refused


def _unlike(learned: Learned, seen: Learned, layers: Layers, dry: int, index: int, twin: Mapping[str, Copy]) -> str:
    """The first of layer `index`'s tensors that its own dry run (`seen`) places otherwise than the
    twin rule (`twin`: layer `dry`'s copies at its parameters), and how; "" where none does."""
    for name in layers.names[index]:
        mine = layers.prefix[dry] + name[len(layers.prefix[index]) :]
        if mine in learned.copies:
            want, got = twin[mine], seen.copies.get(name)
            if got is None or view_key(got.dest) != view_key(want.dest) or got.part != want.part:
                own = _told(got) if got is not None else "not placed"
                return f"{name!r}: {own} by its own dry run, {_told(want)} by the rule"
        elif mine in learned.unused and name not in seen.unused:
            return f"{name!r}: used by its own dry run, unused by the rule"
    return ""


def _told(copy: Copy) -> str:
    part = copy.part
    told = "all of it" if part is None else f"[{part.start}:{part.start + part.length}] of dim {part.dim}"
    return f"{told} into element {copy.dest.storage_offset()} of {tuple(copy.dest.shape)}"


@dataclass
class _Placement:
    """Where a dry-run layer's tensors went: for each placed tensor, (parameter name, view)."""

    index: int
    copies: dict[str, tuple[str, Copy]]
    modules: list[str]  # the model's modules of this layer its copies land in ("model.layers.3")

    def to(
        self, index: int, layers: Layers, model: nn.Module, named: Mapping[str, torch.Tensor]
    ) -> dict[str, Copy] | None:
        """The same copies at layer `index`'s parameters, by the dry-run layer's names; None where
        that layer's model side is not alike."""
        twin_prefix = layers.prefix[index]
        for module in self.modules:
            twin = _renamed(module, twin_prefix, self.index)
            try:
                ours, theirs = model.get_submodule(module), model.get_submodule(twin)
            except AttributeError:
                return None
            if not _alike(ours, theirs, _Own((module, twin), (self.index, index)), {}):
                return None
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter -> (ours, the twin's, detached)
        copies: dict[str, Copy] = {}
        for name, (param, copy) in self.copies.items():
            pair = pairs.get(param)
            if pair is None:
                ours, theirs = named[param], named.get(_renamed(param, twin_prefix, self.index))
                if theirs is None or theirs.untyped_storage().data_ptr() == ours.untyped_storage().data_ptr():
                    return None  # no such parameter, or one both layers share: not a twin's own
                pair = pairs[param] = (ours, theirs.detach().as_subclass(torch.Tensor))
            ours, theirs = pair
            if not _within(copy.dest, ours):
                return None  # a view of another dtype, or reaching past its parameter: offsets do not carry over
            offset = theirs.storage_offset() + copy.dest.storage_offset() - ours.storage_offset()
            copies[name] = Copy(theirs.as_strided(copy.dest.shape, copy.dest.stride(), offset), copy.part)
        return copies


def _placement(learned: Learned, layers: Layers, index: int, owners: Mapping[int, str]) -> _Placement | None:
    """The dry-run layer `index`'s placement, or None when a copy lands outside the model's layers of
    the same index (a model that renumbers its layers: no twins) or none lands at all."""
    copies: dict[str, tuple[str, Copy]] = {}
    modules: dict[str, None] = {}
    for name in layers.names[index]:
        copy = learned.copies.get(name)
        if copy is None:
            continue
        param = owners.get(copy.dest.untyped_storage().data_ptr())
        layer = layer_of(param) if param is not None else None
        if param is None or layer is None or layer.index != index:
            return None
        modules[layer.name] = None
        copies[name] = (param, copy)
    if not modules:  # nothing placed (a pipeline-parallel rank's missing layer): no model layer to compare
        return None
    return _Placement(index, copies, list(modules))


def _within(view: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether `view` has `param`'s dtype and lies inside its elements (so that the same offsets and
    strides at a twin's parameter of the same shape land inside that one)."""
    if view.dtype != param.dtype or view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        return False
    (first, end), (param_first, param_end) = span(view), span(param)
    return param_first <= first and end <= param_end


def _renamed(name: str, twin_prefix: str, index: int) -> str:
    """A model name of layer `index` (`model.layers.3.mlp...`) at the twin's index."""
    layer = layer_of(name)
    assert layer is not None and layer.index == index
    twin = layer_of(twin_prefix)
    assert twin is not None
    return f"{layer.name[: -len(str(index))]}{twin.index}{name[len(layer.name) :]}"


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, types.FunctionType, type)
_DEPTH = 32  # objects nested deeper than this are alike only if they are the same object


class _Own(NamedTuple):
    """What two layers are called: their model names ("model.layers.3") and indices."""

    names: tuple[str, str]
    indices: tuple[int, int]

    def renamed(self, text: str) -> str:
        """`text` with the first layer's name in it (as a whole dotted part: "layers.3" of
        "model.layers.3.mlp", not of "layers.30") made the second's."""
        ours, theirs = (name.rsplit(".", 2)[-2:] for name in self.names)  # ["layers", "3"]
        pattern = rf"(?<![^.]){re.escape('.'.join(ours))}(?![^.])"
        return re.sub(pattern, ".".join(theirs), text) if ".".join(ours) in text else text


def _alike(a: Any, b: Any, own: _Own, seen: dict[tuple[int, int], bool], depth: int = 0) -> bool:
    """Whether two layers' objects are alike but for the layers' own names and indices (`own`): same
    types, equal settings, tensors of equal shapes and strides (small ones of equal values too: an
    expert map), the same loader functions."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, str):  # a layer's own name (`prefix`, `layer_name`): the twin's own
        return a == b or own.renamed(a) == b
    if isinstance(a, _PLAIN):
        return bool(a == b)
    key = (id(a), id(b))
    if key in seen:
        return seen[key]
    seen[key] = True  # a cycle back to this pair: judged where it started
    seen[key] = same = _alike_objects(a, b, own, seen, depth)
    return same


def _alike_objects(a: Any, b: Any, own: _Own, seen: dict[tuple[int, int], bool], depth: int) -> bool:
    if isinstance(a, torch.Tensor):
        if (a.shape, a.stride(), a.dtype, a.device) != (b.shape, b.stride(), b.dtype, b.device):
            return False
        if not isinstance(a, nn.Parameter) and not a.is_meta and a.numel() <= 1 << 16:
            if not torch.equal(a, b):  # settings kept as tensors (an expert map): values matter
                return False
        return _alike(vars(a), vars(b), own, seen, depth + 1) if vars(a) or vars(b) else True
    if depth >= _DEPTH:
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_alike(x, y, own, seen, depth + 1) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(
            _own_index(k, a[k], b[k], own) or _alike(a[k], b[k], own, seen, depth + 1) for k in a
        )
    if isinstance(a, (set, frozenset)):
        return a == b
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__ and _alike(a.__self__, b.__self__, own, seen, depth + 1)
    if isinstance(a, functools.partial):
        return a.func is b.func and _alike((a.args, a.keywords), (b.args, b.keywords), own, seen, depth + 1)
    if isinstance(a, types.BuiltinFunctionType) or (callable(a) and not hasattr(a, "__dict__")):
        return a is b
    try:
        state_a, state_b = vars(a), vars(b)
    except TypeError:  # no __dict__ (slots, C objects): alike only if equal
        try:
            return bool(a == b)
        except Exception:
            return False
    if isinstance(a, nn.Module):  # hooks are the process's, not the layer's settings
        state_a, state_b = ({k: v for k, v in state.items() if "hook" not in k} for state in (state_a, state_b))
    return _alike(state_a, state_b, own, seen, depth + 1)


def _own_index(key: object, a: object, b: object, own: _Own) -> bool:
    """A setting that is each layer's own index (`layer_idx`, `layer_id`): by its name, not only its
    value (a 0/1 switch of layers 0 and 1 is not their index)."""
    return (
        isinstance(key, str)
        and any(word in key for word in ("idx", "index", "layer_id"))
        and type(a) is int
        and type(b) is int
        and (a, b) == own.indices
    )
