"""transformers' internals streamload uses, in one room: its quantizers, its conversion rules and their
operations, its loader's helpers (also for the transformers models in diffusers' pipelines). They are not
its public API and change between releases (5.21 made compressed-tensors' expert decompression read the
fused parameter's dtype from the model), so the integrations reach them only through here, and here knows
each release's way. Tested on transformers 5.19 (vLLM 0.32's pin) and 5.24; a release of another major
version, or one before 5.19 (no conversion rules, or none for compressed-tensors' experts), is refused in
one line before anything is read (`check_version`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from streamload.base.errors import UnsupportedError
from streamload.format.dtypes import as_torch_dtype
from streamload.quant.methods import METHODS, Method

LOWEST = (5, 19)  # the oldest release tested
HIGHEST = (5, 24)  # the newest release tested; later ones of its major version are taken


def version(transformers: Any) -> tuple[int, int]:
    """transformers' (major, minor): "5.24.0" and "5.25.0.dev0" -> (5, 24), (5, 25)."""
    major, minor, *_ = [*str(transformers.__version__).split("."), "0"]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_version(transformers: Any) -> None:
    """Refuses, in one line and before anything is read, a transformers release outside
    [`LOWEST`, the next major version): its internals may not be those this module knows."""
    got = version(transformers)
    if not (LOWEST <= got and got[0] == HIGHEST[0]):
        tested = f"{LOWEST[0]}.{LOWEST[1]} to {HIGHEST[0]}.{HIGHEST[1]} (and later {HIGHEST[0]}.x)"
        raise UnsupportedError(
            f"streamload.from_pretrained is tested with transformers {tested}, and this is transformers "
            f"{transformers.__version__}: install one of those (pip install 'transformers>={LOWEST[0]}.{LOWEST[1]},"
            f"<{HIGHEST[0] + 1}'); nothing was read"
        )


def in_parameter_dtype(method: Method) -> bool:
    """Whether this transformers computes `method`'s weights into their parameter's dtype (else bfloat16),
    the arithmetic otherwise the same: from its record's `in_parameter_dtype_from` release on."""
    import transformers

    since = method.in_parameter_dtype_from
    return since is not None and version(transformers) >= since


def no_init_weights() -> AbstractContextManager[Any]:
    """transformers' own switch that skips `init_weights`: its initialisers keep references to torch's that
    `empty_weights` cannot patch; on meta tensors they cost ~1.5 ms a tensor for nothing. It skips the
    weight tying too: `tied` the model after."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


def tied(model: nn.Module) -> nn.Module:
    """`model` with its tied weights tied, which `init_weights` does and `no_init_weights` skips."""
    if hasattr(model, "tie_weights"):  # a model_class of the user's may have none
        model.tie_weights()
    return model


def config_dtype(config: Any) -> torch.dtype | None:
    """The dtype the config names (`dtype`, into which transformers reads a `torch_dtype`), or None."""
    dtype = getattr(config, "dtype", None)
    return None if dtype is None else as_torch_dtype(dtype)


# -- quantizers ----------------------------------------------------------------------------------------


def hf_quantizer(config: Any) -> Any:
    """transformers' quantizer for the config's `quantization_config`, as its `from_pretrained` makes it;
    ImportError (transformers' own message) where the quantization's package is not installed."""
    from transformers.quantizers.auto import get_hf_quantizer

    return get_hf_quantizer(config, None, None, True, {})[0]


def prepare(quantizer: Any, model: nn.Module, dtype: torch.dtype | None) -> None:
    """The quantizer's modules laid out in `model` for the stored bytes, before weights load, in the model's
    dtype as transformers' loader builds them (a quantized layer's bias is built so)."""
    from transformers.modeling_utils import local_torch_dtype

    with nullcontext() if dtype is None else local_torch_dtype(dtype):
        quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, use_kernels=False)


def finish(quantizer: Any, model: nn.Module) -> None:
    """The quantizer's work after the weights are in, and the model's link to it (as transformers leaves it)."""
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


@dataclass(frozen=True)
class ExpertsDecompression:
    """compressed-tensors' decompression of one expert's weight (transformers' `DecompressExperts`):
    `fp8` (a weight and its scale) or packed (`bits`-bit integers in int32 words, a scale, a shape)."""

    fp8: bool
    bits: int
    in_bfloat16: bool  # FP8 experts come out bfloat16 whatever the parameter's dtype (its record's release rule)
    decompress: Callable[[dict[str, torch.Tensor], torch.dtype], torch.Tensor]  # {part name: tensor}, dtype


def experts_decompression(quantizer: Any) -> ExpertsDecompression | None:
    """How transformers decompresses compressed-tensors experts it merges into fused tensors; None for
    a quantizer that is not compressed-tensors'."""
    if quantizer is None or not hasattr(quantizer, "compressor"):
        return None
    from transformers.integrations.compressed_tensors import DecompressExperts, get_experts_scheme

    scheme = get_experts_scheme(quantizer.quantization_config.quantization_config)
    operation = DecompressExperts(quantizer, scheme=scheme)

    def decompress(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        first = next(iter(parts))
        # 5.21 on it reads the fused parameter's dtype of the model the loader passes (here a stand-in that holds
        # that name only: another raises KeyError); before, neither is read (**kwargs)
        model = SimpleNamespace(get_parameter={first: torch.empty(0, dtype=dtype, device="meta")}.__getitem__)
        out = operation.convert({n: [t] for n, t in parts.items()}, [], [], full_layer_name=first, model=model)
        return out[first][0]

    fp8 = scheme.weights.type == "float" and scheme.weights.num_bits == 8
    in_bfloat16 = not in_parameter_dtype(METHODS["compressed-tensors"])
    return ExpertsDecompression(fp8, scheme.weights.num_bits, in_bfloat16, decompress)


# -- conversion rules -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """A model's conversion rules, as transformers' loader applies them: renamings, converters (each with
    `source_patterns`, `target_patterns` and `operations`), and its key matching."""

    renamings: list[Any]
    converters: list[Any]
    natural_key: Callable[[str], Any]  # the loader's order of keys: experts 0, 1, ..., 10
    rename: Callable[..., tuple[str, str | None]]  # (key, renamings, converters, prefix, meta) -> (target, pattern)


def conversion_rules(model: nn.Module, quantizer: Any = None) -> Rules:
    """transformers' conversion rules for `model` (with the quantizer's own, if one)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return Rules(renamings, converters, dot_natural_key, rename_source_key)


def operation(op: Any) -> tuple[str, tuple[int, ...], bool]:
    """A converter's operation as data: ("stack", (dim,)), ("cat", (dim,)), ("transpose", (dim0, dim1)),
    with whether a tensor already of the parameter's shape is left as it is (a transpose's `check_dims`);
    ("", (), False) for one that computes or splits (refused by the caller)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    if isinstance(op, MergeModulelist):
        return "stack", (op.dim,), False
    if isinstance(op, Concatenate):
        return "cat", (op.dim,), False
    if isinstance(op, Transpose):
        return "transpose", (op.dim0, op.dim1), bool(op.check_dims)
    return "", (), False


def dtype_plan(model: nn.Module, dtype: torch.dtype) -> Callable[[str], torch.dtype | None]:
    """The model's dtype plan (`_keep_in_fp32_modules_strict`: a router's bias stays float32) as a
    lookup: a parameter's name -> the dtype the plan gives it, or None."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return lambda name: None
    from transformers.core_model_loading import build_glob_alternation

    alternation, by_group, _ = build_glob_alternation(list(plan))

    def lookup(name: str) -> torch.dtype | None:
        found = alternation.search(name)
        return None if found is None else plan[by_group[found.lastgroup]]

    return lookup
