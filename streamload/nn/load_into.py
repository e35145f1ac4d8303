"""`load_into`: fill an `nn.Module` (also one built on the meta device) as its weights arrive."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload.base import progress
from streamload.base.errors import StreamloadError, UnsupportedError, listed
from streamload.base.page_release import Release
from streamload.device import resolve
from streamload.nn.layers import LayerStream, layers
from streamload.plan.checkpoint import Checkpoint, Source, open_checkpoint
from streamload.plan.layer_keys import layer_of
from streamload.plan.placement import Conversion
from streamload.plan.plan import Item, cannot_convert, scaled

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options
    from streamload.quant.dequantize import Dequantization

OnLayer = Callable[[str, "nn.Module | None"], "Awaitable[None] | None"]


@dataclass
class LoadResult:
    """What `load_into` did not match: checkpoint names the module lacks, and the reverse."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    left_on_meta: list[str] = field(default_factory=list)


class Filler:
    """Assigns arriving tensors to a module's parameters and buffers (the logic both faces share)."""

    # Weights placed as torch's own `load_state_dict` places them (64-byte aligned, see `aligned`); False:
    # as stored, views of the file mapping kept as they are, as transformers' own `from_pretrained` keeps them.
    aligns = True

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.modules = dict(module.named_modules(remove_duplicate=False))  # each name's owner at once, not by walking
        # Every name a parameter or buffer is reachable by; tied weights share one object, so an
        # arriving tensor is assigned to all of that object's names at once.
        aliases: dict[int, list[str]] = {}
        self.kind: dict[str, str] = {}
        for kind, named in (("parameter", module.named_parameters), ("buffer", module.named_buffers)):
            for name, t in named(remove_duplicate=False):
                aliases.setdefault(id(t), []).append(name)
                self.kind[name] = kind
        self.group_of = {n: names for names in aliases.values() for n in names}
        self.expected = set(module.state_dict(keep_vars=True))  # persistent buffers only
        self.filled: set[str] = set()
        self.result = LoadResult()
        self.dequantization: Dequantization | None = None  # quantized weights computed as they arrive
        self._release = Release()  # the file pages of what was copied out (or computed from) leave
        self.theirs: set[int] = set()  # storages the caller wrote into (`into=`): their pages are theirs

    def target_of(self, name: str) -> str:
        return name

    def assign(self, name: str, tensor: torch.Tensor) -> None:
        names = self.group_of.get(name)
        if names is None:
            self.result.unexpected_keys.append(name)
            return
        placed = aligned(tensor) if self.aligns else tensor
        if placed is not tensor and tensor.untyped_storage().data_ptr() not in self.theirs:
            self._release(tensor)  # copied: the file pages it viewed (ours) need not stay with the process
        new = placed
        if self.kind[name] == "parameter":
            new = nn.Parameter(placed, requires_grad=self.held(name).requires_grad)
        for alias in names:
            owner, attr = self._owner(alias)
            table = owner._parameters if self.kind[alias] == "parameter" else owner._buffers
            table[attr] = new
            self.filled.add(alias)

    def written(self, name: str) -> None:
        """`name` was written in place: it (and the names tied to it) count as filled."""
        names = self.group_of.get(name)
        if names is None:
            self.result.unexpected_keys.append(name)
            return
        self.filled.update(names)  # tied names share the storage

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return self.modules[path], attr

    def held(self, name: str) -> torch.Tensor:
        """The parameter or buffer the module holds under `name` now."""
        owner, attr = self._owner(name)
        return owner._parameters[attr] if self.kind[name] == "parameter" else owner._buffers[attr]  # type: ignore[return-value]

    def groups(self, source: Source, options: Options) -> LayerStream:
        """The stream of groups this filler fills from (the checkpoint's headers read once: the stream
        reuses them), its tensors written where `destinations` says."""
        checkpoint = open_checkpoint(source, options.get("cache_dir"))
        if (computed := self.dequantization) is not None:
            computed.check(checkpoint.tensors)
            options = {**options, "dtype": computed.as_stored(options.get("dtype"))}  # type: ignore[typeddict-item]
        stream = self.destinations(options, checkpoint)
        # What this load gives back nothing of: storages the caller gave to be written (`into=`), and
        # every page while `verify` may still hash the mapped bytes after they were handed out.
        self.theirs = {t.untyped_storage().data_ptr() for t in (stream.get("into") or {}).values()}
        if stream.get("verify"):
            self._release = lambda t: None
        return layers(checkpoint, **stream)

    def destinations(self, options: Options, checkpoint: Checkpoint) -> Options:
        """The stream's options for this filler (assigning needs nothing more)."""
        return options

    def start(self, groups: LayerStream, strict: bool) -> None:
        items, computed = groups.stream.plan.items, self.dequantization
        if strict:
            names = [i.name for i in items]
            self.check_names({self.target_of(n) for n in (computed.targets(names) if computed else names)})
        # The items assigned as they come: not those computed from (dequantized weights, their scales),
        # which the module gets as the computed weight, in its parameter's dtype.
        self.check_dtypes([i for i in items if computed is None or i.name not in computed.names])
        self.check_shapes(self._delivered(items))

    def _delivered(self, items: Collection[Item]) -> dict[str, tuple[object, tuple[int, ...]]]:
        """{name the module gets: (its file, its shape)}: the items assigned as they come, and the
        weights computed from others (by the shape they are computed in)."""
        shapes = {i.name: (i.info.path, _whole_shape(i)) for i in items if i.into is None}
        if self.dequantization is not None:
            for target, (values, *_) in self.dequantization.pairs.items():
                if values in shapes:
                    path, shape = shapes.pop(values)
                    shapes[target] = (path, self.dequantization.format.shape(shape))
        return shapes

    def _assigned_whole(self, target: str) -> bool:
        """Whether `target` gets one tensor as it comes (not regions of it, which `Conversion` checks)."""
        return True

    def check_shapes(
        self, shapes: Mapping[str, tuple[object, tuple[int, ...]]],
        hint: Callable[[str, tuple[int, ...], tuple[int, ...]], str] | None = None,
    ) -> None:  # fmt: skip
        """Before any weight is read: each tensor the module gets whole (`shapes`: name -> (its file,
        its shape)) has the shape its parameter or buffer declares, as torch's `load_state_dict`
        requires ("size mismatch"); `hint` adds where a declared shape came from (a config's field)."""
        wrong: list[str] = []
        for name, (path, shape) in shapes.items():
            target = self.target_of(name)
            if target not in self.group_of or not self._assigned_whole(target):
                continue
            declared = tuple(self.held(target).shape)
            if shape != declared:
                why = hint(target, shape, declared) if hint is not None else ""
                wrong.append(f"{path}: tensor {name!r} is {list(shape)}, {self.kind[target]} {target!r} is "
                             f"{list(declared)}{why}")  # fmt: skip
        if wrong:
            more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
            raise StreamloadError(
                f"loading into {type(self.module).__name__}: shapes differ: {'; '.join(wrong[:3])}{more}; nothing was "
                "read. Check that the checkpoint is this model's, built with the checkpoint's config"
            )

    def check_dtypes(self, items: Collection[Item]) -> None:
        """Before any weight is read: a tensor assigned to a parameter or buffer of another dtype only
        between plain floating-point dtypes (as `dtype=` makes them) or between integer ones: a float8,
        float4 or integer tensor in a floating-point parameter, or the reverse, is a quantized weight
        without its scale."""
        for item in items:
            if item.into is not None or (target := self.target_of(item.name)) not in self.group_of:
                continue  # written in place: the plan checked it; or not the module's
            declared = self.held(target).dtype
            kinds_differ = item.out.is_floating_point != declared.is_floating_point
            if item.out != declared and (scaled(item.out) or scaled(declared) or kinds_differ):
                raise StreamloadError(
                    f"{item.info.path}: tensor {item.name!r} is {item.out}, but {type(self.module).__name__}'s "
                    f"{self.kind[target]} {target!r} is {declared}: {cannot_convert(item.out, declared)}; "
                    "nothing was read. A quantized checkpoint needs a model built for its quantization"
                )

    def fill(self, key: str, tensors: dict[str, torch.Tensor], on_layer: object) -> tuple[str, nn.Module | None] | None:
        """Assign a group's tensors; the (key, submodule) for `on_layer` when the group is a layer
        and there is an `on_layer` (the sync and async faces only differ in how they call it)."""
        arriving = tensors.items() if self.dequantization is None else self.dequantization.apply(
            tensors, lambda name: self.held(self.target_of(name)).dtype, self._release
        )  # fmt: skip
        for name, t in arriving:
            self.assign(name, t)  # (a computed weight is put away before the next is computed)
        if on_layer is not None and layer_of(key + ".") is not None:
            return key, self.modules.get(key)
        return None

    def check_names(
        self, names: Collection[str], fix: str = "pass strict=False to load what matches and leave the rest as it is"
    ) -> None:
        """Before any weight is read: what the module needs and the checkpoint's names cannot give."""
        present = set(names)
        missing = sorted(n for n in self.expected if not any(a in present for a in self.group_of.get(n, [n])))
        unexpected = sorted(n for n in present if n not in self.group_of)
        if parts := _listed_parts(("missing keys", missing), ("unexpected keys", unexpected)):
            raise StreamloadError(
                f"loading into {type(self.module).__name__}: {'; '.join(parts)}; nothing was read. Check that the "
                f"checkpoint is this model's (it holds e.g. {listed(sorted(present)[:3])}), or {fix}"
            )

    def finish(self, strict: bool) -> LoadResult:
        r = self.result
        r.missing_keys = sorted(self.expected - self.filled)
        r.left_on_meta = sorted(
            n for n in self.kind if n not in self.filled and (t := self.held(n)) is not None and t.is_meta
        )
        extra = [n for n in r.left_on_meta if n not in r.missing_keys]
        parts = _listed_parts(
            ("missing keys", r.missing_keys),
            ("unexpected keys", r.unexpected_keys),
            ("left on the meta device, not in the checkpoint", extra),
        )
        if strict and parts:
            raise StreamloadError(f"loading into {type(self.module).__name__}: " + "; ".join(parts))
        return r


def _listed_parts(*named: tuple[str, list[str]]) -> list[str]:
    """Each non-empty list of names as an error lists it ("missing keys: 'a', 'b'")."""
    return [f"{what}: {listed(names)}" for what, names in named if names]


class _InPlaceFiller(Filler):
    """Writes arriving tensors into the module's existing parameters and buffers: every tensor keeps
    its storage (and address), so CUDA graphs and optimisers holding them stay valid. The stream
    writes the staged bytes straight into each destination (`iter(into=...)`), converting to its dtype."""

    def destinations(self, options: Options, checkpoint: Checkpoint) -> Options:
        own = _own_tensors(self, options)
        return _writing_into(options, {n: t for n, t in own.items() if n in checkpoint.tensors})

    def assign(self, name: str, tensor: torch.Tensor) -> None:
        self.written(name)


def _own_tensors(filler: Filler, options: Options) -> dict[str, torch.Tensor]:
    """The module's tensors, to be written in place (none may be on meta, and no dtype= is given)."""
    if options.get("dtype") is not None:
        raise UnsupportedError(
            "load_into(in_place=True) converts each tensor to its parameter's own dtype: leave out dtype="
        )
    tensors = {name: filler.held(name) for name in filler.kind}
    on_meta = [n for n, t in tensors.items() if t is not None and t.is_meta]
    if on_meta:
        raise UnsupportedError(
            f"load_into(in_place=True) writes into the module's tensors, but {listed(on_meta, 5)} "
            "are on the meta device: load without in_place to assign new tensors"
        )
    return {n: t.detach() for n, t in tensors.items() if t is not None}


def _writing_into(options: Options, into: dict[str, torch.Tensor]) -> Options:
    """The stream's options that write into `into` (device: theirs, where they share one and none is given)."""
    devices = {t.device for t in into.values()}
    if options.get("device") is None and len(devices) == 1:
        options = {**options, "device": devices.pop()}
    return {**options, "into": into}


class _ConvertingFiller(Filler):
    """Fills as `Filler` (or, `in_place`, as `_InPlaceFiller`) does, through a `Conversion`: a renamed
    tensor goes to its target's name; a target several tensors fill is allocated once (the
    parameter's dtype, on the stream's device) or, in place, is the module's own, and each source is
    read straight into its region (`into=`); the target counts as filled once all have come."""

    def __init__(self, module: nn.Module, conversion: Conversion, in_place: bool) -> None:
        super().__init__(module)
        self.conversion = conversion
        self.in_place = in_place
        self._fused: dict[str, torch.Tensor] = {}
        self._left: dict[str, int] = {}
        self._computed: dict[str, torch.Tensor] = {}  # regions of weights computed as they arrive (dequantized)

    def destinations(self, options: Options, checkpoint: Checkpoint) -> Options:
        if options.get("into"):
            raise UnsupportedError("load_into(conversion=...) makes the stream's destinations itself: leave out into=")
        stored = checkpoint.tensors
        known = self.dequantization.shapes(stored) if self.dequantization else {n: t.shape for n, t in stored.items()}
        shapes = {n: known[n] for n in self.conversion.regions if n in known}  # computed targets by their shape
        self.conversion.check(shapes)
        if (shard := options.get("shard")) is not None:  # the rank's part of each target, from its sources' parts
            self.conversion, spec = self.conversion.sharded(shard, shapes)
            options = {**options, "shard": spec}
        sources = self.conversion.fused()
        own = _own_tensors(self, options) if self.in_place else {}
        into = {n: own[t] for n in stored if (t := self.conversion.target_of(n)) in own and t not in sources}
        device = resolve(options.get("device"))
        for target, parts in sources.items():
            if target not in self.group_of:
                continue  # reported by check_names (strict) or left unexpected
            if self.in_place:
                whole = own[target]
            else:
                whole = torch.empty(self.conversion.shapes[target], dtype=self._dtype_of(target, parts), device=device)
            self._fused[target] = whole
            self._left[target] = len(parts) or 1
            if not parts:  # a rank's empty part of it: nothing to read
                self.assign(target, whole)
        regions = self.conversion.views(self._fused)
        computed = self.dequantization.pairs if self.dequantization else {}
        self._computed = {n: v for n, v in regions.items() if n in computed}  # copied in once computed
        into |= {n: v for n, v in regions.items() if n not in computed}
        return _writing_into(options, into) if into else options

    def target_of(self, name: str) -> str:
        return self.conversion.target_of(name)

    def _assigned_whole(self, target: str) -> bool:
        return target not in self.conversion.shapes

    def _dtype_of(self, target: str, sources: list[str]) -> torch.dtype:
        """A fused target's dtype: its parameter's, or the one its computed sources all come in."""
        computed = {self.dequantization.dtypes.get(s) for s in sources} if self.dequantization else {None}
        return computed.pop() if len(computed) == 1 and None not in computed else self.held(target).dtype

    def assign(self, name: str, tensor: torch.Tensor) -> None:
        target = self.conversion.target_of(name)
        whole = self._fused.get(target)
        if whole is not None:
            if (region := self._computed.pop(name, None)) is not None:
                region.copy_(tensor)
            self._left[target] -= 1  # the bytes are in its region now
            if self._left[target] > 0:
                return
            tensor = whole
        if self.in_place:
            self.written(target)
        else:
            super().assign(target, tensor)


def _whole_shape(item: Item) -> tuple[int, ...]:
    """The shape of the whole tensor `item` is (a rank's part of, with `shard`): what a module built
    whole declares (the rank's part replaces it as it comes)."""
    shape = list(item.shape)
    if item.part is not None and not item.full_shape:
        shape[item.part.dim] = item.info.shape[item.part.dim]
    return tuple(shape)


# torch's CPU allocator aligns every allocation to 64 bytes; a view of a file mapping sits at its file
# offset, which safetensors aligns to 8 only.
ALIGNMENT = 64


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it at a 64-byte-aligned address when it is a CPU tensor that is not.

    CPU kernels pick their code path by the operands' alignment (a one-row `F.linear` on a weight not
    16-byte aligned sums in another order: results differ in the last bits, and bf16 products ran ~15%
    slower): a model's weights are placed as torch would place them, so its outputs are those of the
    same model built and loaded in torch, whatever the file's layout.
    """
    if tensor.is_cpu and tensor.data_ptr() % ALIGNMENT:  # host memory: CPU kernels read it
        return torch.empty_like(tensor).copy_(tensor)
    return tensor


# torch.nn.init's in-place initialisers: with `empty_weights` they have nothing to initialise.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")  # fmt: skip


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no initialisation) but their
    buffers for real, so that buffers no checkpoint holds (a rotary embedding's `inv_freq`, position
    ids) come out of the module's own constructor, exactly; `load_into` then fills the parameters.

    Not thread-safe: it patches `nn.Module.register_parameter` and `torch.nn.init` while it is open.

    >>> with streamload.empty_weights():  # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_config(config)
    >>> streamload.load_into(model, "model/", device="cuda")  # doctest: +SKIP
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            try:
                meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass that wants more arguments
                meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            self._parameters[name] = meta

    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS if hasattr(torch.nn.init, name)}
    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    for name, fn in saved.items():
        setattr(torch.nn.init, name, _skipping_meta(fn))
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _skipping_meta(initialise: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`initialise`, but a no-op on meta tensors (~1 ms each for `normal_`, for nothing).

    It decides by the tensor, not by whether `empty_weights` is open: a module imported inside the
    block may keep a reference to it (transformers' `initialization` copies torch's initialisers when
    first imported), and that reference must go on initialising real tensors after the block.
    """

    @functools.wraps(initialise)
    def initialise_unless_meta(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if tensor.is_meta else initialise(tensor, *args, **kwargs)

    return initialise_unless_meta


def make_filler(module: nn.Module, in_place: bool, caller: str, conversion: Conversion | None = None) -> Filler:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller} fills a torch.nn.Module, not {type(module).__name__}: build the model first")
    if conversion is not None and conversion.regions:
        return _ConvertingFiller(module, conversion, in_place)
    return _InPlaceFiller(module) if in_place else Filler(module)


@progress.shown  # a bar on a terminal, for a long load (base/progress.py)
def load_into(
    module: nn.Module,
    source: Source,
    *,
    strict: bool = True,
    in_place: bool = False,
    on_layer: Callable[[str, nn.Module | None], Any] | None = None,
    conversion: Conversion | None = None,
    dequantize: Dequantization | None = None,
    **options: Unpack[Options],
) -> LoadResult:
    """Fill `module`'s parameters and buffers from a checkpoint as the tensors arrive.

    Tensors are assigned, not copied (`load_state_dict(assign=True)` semantics), so a module built on
    the meta device (`empty_weights`) ends up holding the loaded tensors with no second copy; tied
    weights stay tied. With `in_place=True` the module's existing tensors are overwritten instead:
    every parameter keeps its storage and address (weights reloaded under captured CUDA graphs or a
    live optimiser), each converted to its parameter's dtype, the bytes going from the staging slot
    (or the file mapping) straight into the parameter.

    Args:
        module: the module to fill.
        source: as for `iter`.
        strict: missing and unexpected keys are an error, raised before any weight is read when the
            checkpoint's names show it; buffers left on meta are one at the end.
        in_place: write into the existing parameters and buffers (same shapes; `device` defaults to
            theirs; no `dtype`) instead of assigning new tensors.
        on_layer: called with (key, submodule) as soon as a layer is complete, while later ones load.
        conversion: checkpoint names -> the regions of the module's tensors they fill (`streamload.plan.placement`):
            renames, module lists merged into one tensor, concatenations, each source read straight
            into its place.
        dequantize: quantized weights computed as each pair of values and scale arrives
            (`streamload.quant.dequantize`: FP8 with block scales, MXFP4), both read as stored whatever `dtype` says.
        **options: the options of `iter` (`Options`: device, dtype, include, ...).

    Returns:
        A `LoadResult`: missing and unexpected keys (empty with `strict`).

    Raises:
        StreamloadError: the checkpoint does not fit the module (with `strict`), or as `iter`.

    Example:
        >>> with streamload.empty_weights():  # doctest: +SKIP
        ...     model = MyModel(config)
        >>> streamload.load_into(model, "model/", device="cuda", on_layer=lambda k, m: warm_up(m))  # doctest: +SKIP
    """
    filler = make_filler(module, in_place, "load_into", conversion)
    return fill(filler, source, strict=strict, on_layer=on_layer, dequantize=dequantize, **options)


def fill(
    filler: Filler,
    source: Source,
    *,
    strict: bool = True,
    on_layer: Callable[[str, nn.Module | None], Any] | None = None,
    dequantize: Dequantization | None = None,
    **options: Unpack[Options],
) -> LoadResult:
    """`load_into` on a filler its caller made (from_pretrained's places weights as transformers does)."""
    filler.dequantization = dequantize
    with filler.groups(source, options) as groups:
        filler.start(groups, strict)
        for key, tensors in groups:
            if (layer := filler.fill(key, tensors, on_layer)) is not None:
                on_layer(*layer)  # type: ignore[misc]
    if dequantize is not None and (left := dequantize.left()):
        what = f"loading into {type(filler.module).__name__}"
        raise StreamloadError(f"{what}: {listed(left)} came without its partner (values or scale)")
    return filler.finish(strict)


async def aload_into(
    module: nn.Module,
    source: Source,
    *,
    strict: bool = True,
    in_place: bool = False,
    on_layer: OnLayer | None = None,
    conversion: Conversion | None = None,
    **options: Unpack[Options],
) -> LoadResult:
    """`load_into` for async code; `on_layer` may be a coroutine function."""
    filler = make_filler(module, in_place, "aload_into", conversion)
    async with filler.groups(source, options) as groups:
        filler.start(groups, strict)
        async for key, tensors in groups:
            if (layer := filler.fill(key, tensors, on_layer)) is not None:
                done = on_layer(*layer)  # type: ignore[misc]
                if inspect.isawaitable(done):
                    await done
    return filler.finish(strict)
