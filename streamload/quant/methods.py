"""Each quantization method streamload knows, as one record keyed by its config's `quant_method`: the
tensor names its checkpoints hold, what its config leaves unsaid (bits, group), how its weights are
computed into plain ones here, and how transformers' own loader treats it (placed as stored, dequantized
where it lacks the kernels, or kept in layers streamload does not fill: refused before reading). A
method is added by one record; `identify`, `dequantize` and `integrations/transformers*.py` read only this.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

from streamload.base.errors import UnsupportedError
from streamload.quant.dequantize import FP8, MXFP4, Dequantization, Format


@dataclass(frozen=True)
class Kernels:
    """What transformers needs to keep a method's layers quantized; without it, it dequantizes them."""

    capability: tuple[int, int]  # a CUDA GPU's compute capability, at least
    packages: tuple[str, ...] = ()  # importable beside it


@dataclass(frozen=True)
class Method:
    """One quantization method: its tensors' name endings, its defaults, its computation, transformers' rules."""

    name: str  # the config's `quant_method`
    scales: tuple[str, ...] = ()  # endings of the scales, zero points and indices beside a quantized weight
    weights: tuple[str, ...] = ()  # endings of its quantized weights, where they are not named `.weight`
    others: tuple[str, ...] = ()  # endings of what else only its checkpoints hold (shapes, formats)
    # endings a plain model may use too ("layer_scales", "rotary_blocks"): a scale only beside one of its
    # `weights`, a weight only beside one of its `scales`
    generic: tuple[str, ...] = ()
    bits: int | None = None  # of a weight value, where its config does not say
    group: str | None = None  # where its config does not say
    computed: Format | None = None  # how streamload computes its weights into plain ones (None: it does not)
    as_stored: bool = False  # transformers' loader puts its tensors as stored into its quantizer's layers
    kernels: Kernels | None = None  # transformers keeps it quantized only with these (None: always)
    # the transformers release from which what it computes of this method (its dequantized weights;
    # compressed-tensors' FP8 experts) comes out in the parameter's dtype, not bfloat16
    in_parameter_dtype_from: tuple[int, int] | None = None


METHODS: dict[str, Method] = {m.name: m for m in (
    # transformers' FineGrainedFP8 (DeepSeek-V3/R1, Qwen3-FP8): float8 weights, a scale per block
    Method("fp8", scales=(".weight_scale_inv",), bits=8, computed=FP8, as_stored=True, kernels=Kernels((8, 9))),
    # gpt-oss's experts: 4-bit floats in blocks of 32 sharing an 8-bit exponent
    Method("mxfp4", scales=("_scales",), weights=("_blocks",), generic=("_scales", "_blocks"), bits=4,
           group="blocks of 32",
           computed=MXFP4, kernels=Kernels((7, 5), ("triton", "kernels")), in_parameter_dtype_from=(5, 23)),
    # llm-compressor's: int8 or FP8 by channel or tensor, packed 4-bit, NVFP4 (bits and groups in config_groups)
    Method("compressed-tensors", scales=(".weight_scale", ".input_scale", ".weight_zero_point", ".weight_g_idx",
           ".weight_global_scale"), weights=(".weight_packed",), others=(".weight_shape",), as_stored=True,
           in_parameter_dtype_from=(5, 21)),
    Method("gptq", scales=(".qzeros", ".scales", ".g_idx"), weights=(".qweight",), generic=(".scales",)),
    Method("awq", scales=(".qzeros", ".scales"), weights=(".qweight",), generic=(".scales",)),
    Method("bitsandbytes", scales=(".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4",
           ".quant_state.bitsandbytes__fp4", ".SCB"), others=(".quant_state", ".weight_format")),
)}  # fmt: skip


def _every(field: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(e for m in METHODS.values() for e in getattr(m, field)))


SCALES = _every("scales")  # endings of scales, zero points, indices: any method's
WEIGHTS = _every("weights")  # endings of quantized weights not named `.weight`
ENDINGS = SCALES + WEIGHTS + _every("others")  # every name ending only a quantized checkpoint holds
# a generic ending -> the endings it counts beside (a scale's weights, a weight's scales)
_PARTNERS = {e: tuple(p for m in METHODS.values() if e in m.generic for p in (m.weights if e in m.scales else m.scales))
             for e in _every("generic")}  # fmt: skip


def quantized_name(name: str, names: Container[str]) -> bool:
    """Whether `name` (of the checkpoint's `names`) is one only a quantized checkpoint holds: a generic
    ending (GPTQ's `.scales`, MXFP4's `_scales` and `_blocks`) only beside its partner."""
    if not name.endswith(ENDINGS):
        return False
    generic = next((e for e in _PARTNERS if name.endswith(e)), None)
    return generic is None or any(name.removesuffix(generic) + w in names for w in _PARTNERS[generic])


def dequantization(name: str, names: Iterable[str]) -> Dequantization:
    """The tensors of `names` that method `name` (a `quant_method`) computes from, paired by its `Format`
    (`load_into(dequantize=...)`); UnsupportedError where streamload does not know or compute the method."""
    known = METHODS.get(name)
    if known is None:
        raise UnsupportedError(f"quant_method {name!r}: streamload knows {', '.join(METHODS)}")
    if known.computed is None:
        can = ", ".join(m.name for m in METHODS.values() if m.computed is not None)
        raise UnsupportedError(f"quant_method {name!r}: streamload computes the weights of {can} only")
    return Dequantization.of(known.computed, names)
