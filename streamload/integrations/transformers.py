"""transformers: a checkpoint directory (or object-storage prefix) -> a ready model (`streamload.from_pretrained`).

config.json -> the model built with `empty_weights` (parameters on meta, buffers real) -> weights streamed in
by `load_into` (tied weights stay tied) -> the remaining buffers moved to the device -> `eval()`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload.api import inspect
from streamload.base.errors import StreamloadError, UnsupportedError, listed
from streamload.device import default_kind, resolve
from streamload.format.dtypes import as_torch_dtype
from streamload.integrations import transformers_internals
from streamload.integrations.device_map import check_mapped
from streamload.nn.load_into import Filler, OnLayer, empty_weights, fill, make_filler
from streamload.plan.placement import Conversion, Region, Step
from streamload.quant.dequantize import Dequantization, Format
from streamload.quant.methods import METHODS, Kernels, Method, quantized_name
from streamload.storage.base import redacted
from streamload.storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    model_class: type[nn.Module] | None = None,
    on_layer: OnLayer | None = None,
    strict: bool = True,
    trust_remote_code: bool = False,
    mapped: Collection[str] = (),
    **options: Unpack[Options],
) -> nn.Module:
    """`streamload.from_pretrained` for a transformers folder (or its object-storage prefix: config.json
    fetched, the weights streamed), in eval mode on `device`; the arguments as documented there, and:

    dtype: also "auto" as transformers takes it: the config's `dtype`, else the first floating-point tensor's of
        the first weight file; None (transformers' own default): the config's, else each tensor as stored.
    model_class: default the config's `architectures[0]`, else `AutoModel`.
    trust_remote_code: from a local folder only; the model class is the `auto_map` entry of `architectures[0]`.
    mapped: the module names a device_map placed: each must be one of the built model's.
    """
    try:
        import transformers
    except ImportError as exc:
        raise UnsupportedError("from_pretrained needs transformers: pip install -e '.[transformers]'") from exc
    transformers_internals.check_version(transformers)  # internals of the releases tested, or nothing is read
    source: str | Path = str(path) if is_url(str(path)) else Path(path)
    if trust_remote_code and not isinstance(source, Path):
        raise UnsupportedError(
            f"{redacted(source)}: trust_remote_code=True runs the model's Python files from a local folder, and "
            "from object storage only its config and weights are fetched: copy the folder here first"
        )
    dev = resolve(device)
    config = _config(transformers, source, trust_remote_code)
    checkpoint = None
    if dtype is None or dtype == "auto":
        auto, dtype = dtype == "auto", transformers_internals.config_dtype(config)
        if auto and dtype is None:  # transformers' "auto": else the weights'
            checkpoint = inspect(source, options.get("cache_dir"))
            dtype = _stored_dtype(checkpoint)
    else:
        dtype = as_torch_dtype(dtype)
    if dtype not in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):  # torch's default, built in
        raise UnsupportedError(
            f"dtype={dtype}: a model is built in torch.float16, torch.bfloat16, torch.float32 or torch.float64 "
            "(or 'auto': the config's, else the weights'); float8 weights come from a quantized checkpoint, "
            "whose config says so"
        )
    quantizer = placing_quantizer(config)
    model = _model(transformers, config, model_class, dtype, quantizer, trust_remote_code)
    check_mapped(path, mapped, model)
    if checkpoint is None:
        checkpoint = inspect(source, options.get("cache_dir"))
    filler, computed, placed = _filler(model, config, quantizer, checkpoint.tensors, strict)
    if dtype is not None:  # each tensor as its parameter was built (transformers keeps some in float32)
        dtype = _dtypes(model, placed, checkpoint.tensors, dtype)
    fill(filler, checkpoint, device=dev, dtype=dtype, strict=strict, on_layer=on_layer, dequantize=computed, **options)
    model.to(dev)  # the buffers the constructor made on the CPU; parameters are there already
    if quantizer is not None:
        transformers_internals.finish(quantizer, model)
    return model.eval()


def _model(
    transformers: Any, config: Any, model_class: type[nn.Module] | None, dtype: torch.dtype | None, quantizer: Any,
    trust_remote_code: bool,
) -> nn.Module:  # fmt: skip
    """The model built on meta in `dtype` (its buffers real), laid out by `quantizer`, its tied weights tied."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    # transformers' switch first: its module, imported on first use, copies torch's initialisers
    with transformers_internals.no_init_weights(), empty_weights():
        if model_class is None:
            model = _build(transformers, config, kwargs, trust_remote_code)
        elif hasattr(model_class, "_from_config"):
            model = model_class._from_config(config, **kwargs)
        else:
            model = model_class(config)
        if quantizer is not None:  # its modules, laid out for the stored bytes, as transformers' loader does
            transformers_internals.prepare(quantizer, model, dtype)
    return transformers_internals.tied(model)


def _filler(
    model: nn.Module, config: Any, quantizer: Any, stored: Mapping[str, Any], strict: bool
) -> tuple[Filler, Dequantization | None, Conversion]:
    """Where each stored tensor goes in `model` (what is computed as it streams, the placement as
    transformers' loader has it), checked against the model before any weight is read."""
    computed, placed = dequantization(config, stored), None
    if computed is None and (experts := decompressed_experts(quantizer, model, stored)) is not None:
        computed, placed = experts  # placed as computed: the quantizer's conversions would decompress them
    shapes = computed.shapes(stored) if computed else {n: tuple(t.shape) for n, t in stored.items()}
    if placed is None:
        placed = conversion(model, shapes, None if computed else quantizer)
    filler = make_filler(model, False, "from_pretrained", placed)
    filler.aligns = False  # views of the file kept as stored, as transformers' own loader keeps them
    fits(filler, config, placed.targets(shapes), strict)
    shapes_fit(filler, config, placed, shapes, stored, computed)
    return filler, computed, placed


def _stored_dtype(checkpoint: Any) -> torch.dtype | None:
    """As transformers reads "auto" from the weights: the first floating-point tensor (by name) of the first
    file; else the first tensor's; None for no tensors (the model is then built in torch's default)."""
    first = sorted(checkpoint.files[0].tensors, key=lambda t: t.name) if checkpoint.files else []
    chosen = next((t for t in first if t.dtype.torch_dtype.is_floating_point), first[0] if first else None)
    return None if chosen is None else chosen.dtype.torch_dtype


def _kept(method: Method, config: Any) -> bool:
    """Whether transformers' own loader keeps `method`'s layers quantized here: always where it needs no
    kernels; else where it has them (`method.kernels`) and the config does not say `dequantize: true`."""
    return method.kernels is None or not (_quantization(config, "dequantize") or _kernels_missing(method.kernels))


def placing_quantizer(config: Any) -> Any | None:
    """transformers' own quantizer where its loader puts the stored tensors as they are into the layers it
    lays out (the method's `as_stored`, kept quantized here): streamload reads them straight in. Else None;
    UnsupportedError where the quantization's package is not installed."""
    method = METHODS.get(_quantization(config, "quant_method"))
    if method is None or not (method.as_stored and _kept(method, config)):
        return None
    try:
        return transformers_internals.hf_quantizer(config)
    except ImportError as exc:
        raise UnsupportedError(f"{method.name} checkpoint: {exc}") from None


def dequantization(config: Any, stored: Mapping[str, Any]) -> Dequantization | None:
    """The quantized tensors transformers' own loader dequantizes here (not kept quantized), computed as
    they stream; None for anything else (a quantized checkpoint is then refused by `fits`)."""
    method = METHODS.get(_quantization(config, "quant_method"))
    if method is None or method.computed is None or _kept(method, config):
        return None  # transformers keeps them quantized in its own layers here: refused, named by `fits`
    fmt = method.computed
    if transformers_internals.in_parameter_dtype(method):  # else the format's own (bfloat16) whatever the model's
        fmt = dataclasses.replace(fmt, own_dtype=lambda parts: None)
    return Dequantization.of(fmt, stored)


def decompressed_experts(
    quantizer: Any, model: nn.Module, stored: Mapping[str, Any]
) -> tuple[Dequantization, Conversion] | None:
    """compressed-tensors experts that transformers 5 merges into fused tensors (its `DecompressExperts`
    conversion: every other quantized layer stays as stored): each expert's weight decompressed by
    transformers' own operation as its packed values, scale and shape arrive, then copied into its
    region of the fused parameter; with the checkpoint's placement as computed. None where there are none."""
    how = transformers_internals.experts_decompression(quantizer)
    if how is None:
        return None
    fp8 = how.fp8  # plain (weight, scale) pairs
    ending = ".weight" if fp8 else ".weight_packed"
    widen = 1 if fp8 else 32 // how.bits  # packed: `bits`-bit integers in int32 words

    def parts(target: str) -> tuple[str, ...]:
        return (target, target + "_scale") if fp8 else (target + "_packed", target + "_scale", target + "_shape")

    def dtype(infos: list[Any]) -> torch.dtype | None:  # FP8: bfloat16 or the parameter's; packed: the scale's
        return (torch.bfloat16 if how.in_bfloat16 else None) if fp8 else infos[1].dtype.torch_dtype

    def decompress(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        names = parts("expert.weight")  # transformers' own operation, on one expert's parts
        return how.decompress(dict(zip(names, tensors, strict=False)), dtype)

    def target(name: str) -> str | None:
        return name.removesuffix(ending) + ".weight" if ".experts." in name and name.endswith(ending) else None

    fmt = Format(parts, target, lambda s: (*s[:-1], s[-1] * widen), decompress, own_dtype=dtype)
    candidates = Dequantization.of(fmt, stored)
    if not candidates.pairs:
        return None
    placed = conversion(model, candidates.shapes(stored))
    merged = {n for sources in placed.fused().values() for n in sources}
    if merged >= candidates.pairs.keys():
        return candidates, placed
    chosen = Dequantization(fmt, {t: p for t, p in candidates.pairs.items() if t in merged})  # only those merged
    return chosen, conversion(model, chosen.shapes(stored))


def _kernels_missing(kernels: Kernels) -> bool:
    """transformers keeps a method quantized only on a GPU of `kernels.capability` or more with its `packages`
    (FineGrainedFP8: 8.9; Mxfp4: 7.5, triton and `kernels`; on the CPU it always dequantizes them)."""
    from importlib.util import find_spec

    capability = default_kind().compute_capability()  # None: no GPU
    on_gpu = capability is not None and capability >= kernels.capability
    return not (on_gpu and all(find_spec(p) is not None for p in kernels.packages))


def _quantization(config: Any, key: str) -> Any:
    """A setting of the config's `quantization_config` (a dict, or transformers' config object)."""
    quantization = getattr(config, "quantization_config", None)
    return quantization.get(key) if isinstance(quantization, dict) else getattr(quantization, key, None)


def fits(filler: Filler, config: Any, names: Iterable[str], strict: bool) -> None:
    """Before any weight is read: the checkpoint's `names` (as placed in the model) against what the
    model needs, each mismatch named with the remedy that really applies. strict=False only drops
    unexpected keys and keeps a missing buffer's initial value: the parameters are built on meta, so
    one the checkpoint lacks would have no values at all, and a quantized checkpoint's weights are
    not the unquantized model's (loading what matches would give wrong values)."""
    model = filler.module
    present = set(names)
    missing = sorted(n for n in filler.expected if not any(a in present for a in filler.group_of.get(n, [n])))
    unexpected = sorted(n for n in present if n not in filler.group_of)
    if not (missing or unexpected):
        return
    what = type(model).__name__
    parts = [f"missing keys: {listed(missing, 10)}"] if missing else []
    parts += [f"unexpected keys: {listed(unexpected, 10)}"] if unexpected else []
    marked = [n for n in unexpected if quantized_name(n, present)]
    if getattr(config, "quantization_config", None) is not None or marked:
        method = _quantization(config, "quant_method")
        how = f"its config's quant_method is {str(method)!r}" if method else f"it holds {listed(marked, 3)}"
        raise UnsupportedError(
            f"loading into {what}: the checkpoint is quantized ({how}); streamload.from_pretrained builds the "
            "unquantized model and cannot fill it from quantized weights (with strict=False it would load wrong "
            "values or none): load it with transformers' own from_pretrained, or serve it with vLLM; nothing "
            f"was read ({'; '.join(parts)})"
        )
    empty = [n for n in missing if filler.held(n).is_meta]
    if not (strict or empty):
        return
    if empty:
        fix = (f"; strict=False does not help: the model's {listed(empty, 5)} would have no values (no checkpoint "
               "tensor lands there)")  # fmt: skip
    else:
        fix = ", or pass strict=False to load the keys that match: the unexpected keys are ignored" + (
            ", the missing buffers keep their initial values" if missing else ""
        )
    shown = listed(sorted(present)[:3])
    raise StreamloadError(
        f"loading into {what}: {'; '.join(parts)}; nothing was read. Check that the checkpoint is this model's "
        f"(it holds e.g. {shown}){fix}"
    )


def shapes_fit(
    filler: Filler, config: Any, placed: Conversion, shapes: Mapping[str, tuple[int, ...]],
    stored: Mapping[str, Any], computed: Dequantization | None,
) -> None:  # fmt: skip
    """Before any weight is read: each tensor the model gets whole has its parameter's shape (what
    transformers refuses without `ignore_mismatched_sizes`), the config's fields that gave the
    parameter its shape named."""
    files = {n: t.path for n, t in stored.items()} | {
        t: stored[p[0]].path for t, p in (computed.pairs if computed else {}).items()
    }
    whole = {t: (files[n], tuple(s)) for n, s in shapes.items() if (t := placed.target_of(n)) not in placed.shapes}
    settings = {k: v for k, v in config.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)}

    def fields(target: str, shape: tuple[int, ...], declared: tuple[int, ...]) -> str:
        dims = {d for got, d in zip(shape, declared, strict=False) if got != d}
        named = [f"{k} = {v}" for k, v in settings.items() if v in dims]
        return f" (the config's {', '.join(named)})" if named else ""

    filler.check_shapes(whole, fields)


def conversion(model: nn.Module, shapes: dict[str, tuple[int, ...]], quantizer: Any = None) -> Conversion:
    """Where transformers' own `from_pretrained` would put each checkpoint tensor of `shapes` in
    `model`, from its conversion rules for this model (renames, module lists merged into one tensor,
    concatenations, transposes) and its own key matching, as data. A rule that computes (or that
    splits a tensor between parameters) is refused before a byte is read, naming the model type and
    the operation."""
    rules = transformers_internals.conversion_rules(model, quantizer)
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    by_pattern = {p: c for c in rules.converters for p in c.source_patterns}
    regions: dict[str, Region] = {}
    merged: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # target -> (converter, {source pattern: keys})
    for key in sorted(shapes, key=rules.natural_key):  # transformers' own order: experts 0, 1, ..., 10
        target, pattern = rules.rename(key, rules.renamings, rules.converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = rules.rename(key, [], [], prefix, meta)
        if target not in meta:
            continue  # an unexpected key: load_into says so
        if pattern is None:
            if target != key:
                regions[key] = Region(target)
            continue
        converter, inputs = merged.setdefault(target, (by_pattern[pattern], {}))
        inputs.setdefault(pattern, []).append(key)
    fused: dict[str, tuple[int, ...]] = {}
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    for target, (converter, inputs) in merged.items():
        tree = _placed(converter, inputs, shapes, tuple(meta[target].shape), model_type, target)
        fused[target] = tree.shape
        regions |= {key: Region(target, steps) for key, steps in tree.leaves(())}
    return Conversion(regions, fused)


def _dtypes(model: nn.Module, placed: Conversion, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.dtype]:
    """{checkpoint name: dtype} as transformers' own loader chooses it for the model tensor the name
    lands in: its dtype plan (`_keep_in_fp32_modules_strict`: a router's bias stays float32), else
    the tensor's own dtype where the model was built in another, else `dtype` ("*")."""
    own = {n: t.dtype for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_floating_point()}
    planned = transformers_internals.dtype_plan(model, dtype)
    kept: dict[str, torch.dtype] = {}
    for n in names:
        target = placed.target_of(n)
        if (chosen := planned(target)) is not None:
            kept[n] = chosen
        elif target in own and own[target] != dtype:
            kept[n] = own[target]
    return {**kept, "*": dtype}


class _Node:
    """A tensor a conversion builds, as a tree: a source (`key`), or parts stacked, concatenated or
    transposed (`how`, the dims), with the shape it has."""

    def __init__(self, shape: tuple[int, ...], key: str = "", how: str = "", dims: tuple[int, ...] = (),
                 parts: list[_Node] | None = None) -> None:  # fmt: skip
        self.shape, self.key, self.how, self.dims, self.parts = shape, key, how, dims, parts or []

    def leaves(self, steps: tuple[Step, ...]) -> list[tuple[str, tuple[Step, ...]]]:
        """(source, the steps from the whole tensor to its region), for every source under this node."""
        if self.key:
            return [(self.key, steps)]
        out: list[tuple[str, tuple[Step, ...]]] = []
        at = 0
        for i, part in enumerate(self.parts):
            if self.how == "stack":
                out += part.leaves((*steps, ("select", self.dims[0], i, 0)))
            elif self.how == "cat":
                n = part.shape[self.dims[0]]
                out += part.leaves((*steps, ("narrow", self.dims[0], at, n)))
                at += n
            else:  # transpose: the part is the whole transposed back
                out += part.leaves((*steps, ("transpose", self.dims[0], self.dims[1], 0)))
        return out


def _placed(
    converter: Any, inputs: dict[str, list[str]], shapes: dict[str, tuple[int, ...]], target_shape: tuple[int, ...],
    model_type: str, target: str,
) -> _Node:  # fmt: skip
    """transformers' chain of operations for one target, run on shapes and names instead of tensors
    (each operation as transformers' own `convert` treats its inputs)."""
    values = {p: [_Node(tuple(shapes[k]), k) for k in keys] for p, keys in inputs.items()}  # one node after an op
    targets = converter.target_patterns
    for op in converter.operations:
        how, dims, check_dims = transformers_internals.operation(op)
        if how == "stack":
            out: dict[str, list[_Node]] = {}
            for pattern, parts in values.items():
                shape = (*parts[0].shape[: dims[0]], len(parts), *parts[0].shape[dims[0] :])
                if any(p.shape != parts[0].shape for p in parts):
                    raise UnsupportedError(f"{model_type}: {target!r}: the tensors merged differ in shape")
                out[targets[0] if len(values) == 1 else pattern] = [_Node(shape, how="stack", dims=dims, parts=parts)]
            values = out
        elif how == "cat":
            dim = dims[0]
            parts = [part for pattern in converter.source_patterns for part in values.get(pattern, [])]  # their order
            shape = list(parts[0].shape)
            if any(len(p.shape) != len(shape) or [*p.shape[:dim], *p.shape[dim + 1 :]] != [
                    *shape[:dim], *shape[dim + 1 :]] for p in parts):  # fmt: skip
                shown = ", ".join(str(list(p.shape)) for p in parts)
                raise UnsupportedError(f"{model_type}: {target!r}: the tensors concatenated differ in shape ({shown})")
            shape[dim] = sum(p.shape[dim] for p in parts)
            values = {targets[0]: [_Node(tuple(shape), how="cat", dims=dims, parts=parts)]}
        elif how == "transpose" and len(values) == 1:
            part = next(iter(values.values()))[0]
            if check_dims and part.shape == target_shape:
                continue  # transformers leaves a tensor already of the parameter's shape as it is
            shape = list(part.shape)
            shape[dims[0]], shape[dims[1]] = shape[dims[1]], shape[dims[0]]
            values = {targets[0]: [_Node(tuple(shape), how="transpose", dims=dims, parts=[part])]}
        else:
            raise UnsupportedError(
                f"{model_type}: transformers converts {target!r} with {type(op).__name__}, which streamload does "
                "not place while streaming (it computes, or splits a tensor between parameters); nothing was read"
            )
    if len(values) != 1:
        raise UnsupportedError(f"{model_type}: {target!r}: transformers' conversion leaves {len(values)} tensors")
    (nodes,) = values.values()
    got = list(nodes[0].shape) if len(nodes) == 1 else None
    if got != list(target_shape):
        raise UnsupportedError(
            f"{model_type}: {target!r} would be {got} from the checkpoint, the model's is {list(target_shape)}"
        )
    return nodes[0]


def _config(transformers: Any, source: str | Path, trust_remote_code: bool) -> Any:
    """The model's config: from the folder, or fetched from the object store's prefix."""
    if isinstance(source, Path):
        return _read_config(transformers, source, source / "config.json", trust_remote_code)
    from streamload.integrations.startup.prefetch import beside
    from streamload.storage import storage_for

    near = beside(source)
    raw = storage_for(source).sidecar(near, "config.json")
    if raw is None:
        raise UnsupportedError(
            f"{redacted(near.parent)}/config.json: no such object; from_pretrained needs the model's config"
        )
    with tempfile.TemporaryDirectory(prefix="streamload-config-") as folder:
        Path(folder, "config.json").write_bytes(raw)
        return _read_config(transformers, Path(folder), f"{redacted(near.parent)}/config.json", False)


def _read_config(transformers: Any, folder: Path, shown: object, trust_remote_code: bool) -> Any:
    # trust_remote_code given as a bool: transformers asks on a terminal (and waits) when it is None
    trusted = bool(trust_remote_code)
    try:
        return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trusted)  # nosec B615 # a local folder: no hub download
    except (ValueError, OSError) as exc:  # not JSON, no model_type, a model_type this transformers lacks
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not trusted and "trust_remote_code" in str(exc):
            reason += " (its auto_map names Python files beside it; pass trust_remote_code=True to run them)"
        raise UnsupportedError(f"{shown}: transformers cannot read this config: {reason}") from None


def _build(transformers: Any, config: Any, kwargs: dict[str, Any], trust_remote_code: bool) -> nn.Module:
    names = getattr(config, "architectures", None) or []
    auto = _trusted_auto_class(transformers, config, names) if trust_remote_code else None
    if auto is not None:  # the model class from the folder's code, as transformers' auto class resolves it
        return auto.from_config(config, trust_remote_code=True, **kwargs)
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls._from_config(config, **kwargs)
    if names:
        raise UnsupportedError(f"this transformers ({transformers.__version__}) has no model class {names[0]!r}")
    return transformers.AutoModel.from_config(config, **kwargs)


def _trusted_auto_class(transformers: Any, config: Any, names: list[str]) -> Any | None:
    """transformers' auto model class under which the config's `auto_map` names the model's own class: the
    entry whose class is `architectures[0]`, else `AutoModel`'s, else the first; None where it names none.
    Only transformers' own auto classes are looked up (a key from the file names no other attribute)."""
    entries = {k: v for k, v in (getattr(config, "auto_map", None) or {}).items()
               if k.startswith("AutoModel") and isinstance(v, str)}  # fmt: skip
    by_class = [k for k, v in entries.items() if names and v.rsplit(".", 1)[-1] == names[0]]
    for key in [*by_class, "AutoModel", *entries]:
        auto = getattr(transformers, key, None) if key in entries else None
        if auto is not None and callable(getattr(auto, "from_config", None)):
            return auto
    return None
