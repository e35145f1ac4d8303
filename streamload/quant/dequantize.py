"""Quantized weights computed into plain ones as their layer streams in, as transformers computes them
where it dequantizes (on a machine without the format's kernels, or `dequantize=True`):

- FP8 with a scale per block (`x.weight` + `x.weight_scale_inv`: DeepSeek-V3/R1, Qwen3-FP8; float32, or
  MXFP8's E8M0 exponents as uint8 or float8_e8m0fnu): the float8 values times their block's scale in
  float32, cast to the parameter's dtype;
- MXFP4 (`x_blocks` + `x_scales`: gpt-oss experts): 4-bit floats in blocks of 32 sharing an 8-bit
  exponent, into bfloat16 (whatever the model's dtype: transformers leaves them so), transposed to
  the experts' [experts, in, out] layout.

A tensor and its scale belong to one layer and arrive in its group; each pair is computed once both
are in (one whose partner comes in a later group waits for it), so memory is one layer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from streamload.base.errors import StreamloadError

if TYPE_CHECKING:
    from streamload.format.header import TensorInfo
    from streamload.plan.plan import DTypeOption


def fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` (float8, [..., rows, cols]) times the scale of each of its blocks (`scale`: [..., rows /
    block rows, cols / block cols]: read by `fp8_scales`), in float32, cast to `dtype` (transformers'
    `Fp8Dequantize`)."""
    rows, cols = weight.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:] if scale.dim() >= 2 else (1, 1)  # whole blocks: `_fp8_grid`
    if weight.numel() < _FEWEST or not weight.is_cpu:  # torch's own, in place: the fewest operations
        values = weight.to(torch.float32)
        blocks = values.view(-1, scale_rows, rows // scale_rows, scale_cols, cols // scale_cols)
        blocks.mul_(fp8_scales(scale).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2))
        return values.to(dtype)
    block_rows = rows // scale_rows
    values = weight.reshape(-1, block_rows, cols)  # [block rows of every matrix, block's rows, cols]
    grid = fp8_scales(scale).reshape(-1, scale_rows, scale_cols)  # one grid, or one a matrix
    scales = grid.expand(values.shape[0] // scale_rows, -1, -1).reshape(-1, 1, scale_cols, 1)
    step = max(1, _CHUNK // (block_rows * cols))  # block rows at a time: its temporaries stay in the cache
    # A chunk's temporaries (float32 result, float16 bits, a byte each), made once a weight (made a chunk,
    # they left holes in the heap that a load's parameters, allocated between them, kept from going
    # back: ~0.07x of a model's bytes)
    n = min(step, values.shape[0]) * block_rows * cols
    scratch = [torch.empty(n, dtype=d) for d in (torch.float32, torch.int16, torch.uint8)]
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    into = out.view(-1, block_rows, cols)
    for at in range(0, values.shape[0], step):
        part = values[at : at + step]
        work = [t[: part.numel()].view(part.shape) for t in scratch]
        chunk, power = _float8_as_float32(part, scales[at : at + step], work)
        chunk.view(-1, block_rows, scale_cols, cols // scale_cols).mul_(scales[at : at + step] * power)
        into[at : at + step] = chunk
    return out


def fp8_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 multipliers, as transformers' `Fp8Dequantize` reads them: uint8 bytes are
    E8M0 exponents (MXFP8 checkpoints), 2 ** (byte - 127), 255 giving inf (float32's 2 ** 128); a
    float8_e8m0fnu scale is torch's own conversion (255 is its NaN); any other dtype is its value."""
    if scale.dtype == torch.uint8:  # the raw byte as a number would be a scale 127x too large (or worse)
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


# float8 -> float16 by its bits: float16 holds every float8 value exactly, and torch converts float16
# to float32 ~40x faster than float8 on a CPU (vectorized), which bounded a load's dequantization.
# E4M3's bits shifted into float16's are its value / 2**8 (its exponent bias is 7, float16's 15; its
# subnormals land on float16's), so the scale is taken times 2**8: the product, rounded once, is the
# same float32. E5M2 is float16's upper byte. Done a chunk of block rows at a time (~2**20 values:
# a 2048 x 2048 weight whole took 1.7x as long, its temporaries out of the cache; 2**18 cost an expert
# of 512 x 1024 as much in operations a chunk), and only on the CPU where a tensor has enough values
# to repay the few more operations (a 128 x 128 expert does not).
_CHUNK = 1 << 20
_FEWEST = 1 << 16
_HALF_SCALE = 2.0**100  # a scale this large times 2**8 could overflow where its product does not


def _float8_as_float32(
    weight: torch.Tensor, scale: torch.Tensor, scratch: list[torch.Tensor]
) -> tuple[torch.Tensor, float]:
    """`weight`'s values as float32 (in `scratch`'s first tensor; the others are worked in) divided by
    the returned power of two (torch's own conversion, power 1, where a value is NaN, whose bits
    float16 does not share, or where the scale is out of range). `fp8_blocks` calls it only on the
    CPU, for tensors of `_FEWEST` values or more."""
    values, bits, spare = scratch
    stored = weight.view(torch.uint8)
    if weight.dtype == torch.float8_e5m2:
        bits.copy_(stored).bitwise_left_shift_(8)
        return values.copy_(bits.view(torch.float16)), 1.0
    if weight.dtype != torch.float8_e4m3fn or not bool(scale.abs().max() < _HALF_SCALE):
        return values.copy_(weight), 1.0
    if int(torch.bitwise_and(stored, 0x7F, out=spare).max()) == 0x7F:
        return values.copy_(weight), 1.0  # E4M3's NaN: S.1111.111
    # the byte sign-extended then shifted: the sign's copies above bit 14 leave with the mask 0xBFFF
    bits.copy_(weight.view(torch.int8)).bitwise_left_shift_(7).bitwise_and_(-0x4001)
    return values.copy_(bits.view(torch.float16)), 2.0**8


# The 16 values of an FP4 (E2M1) nibble, by its bits.
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 `blocks` (uint8 [experts, out, groups, 16]: two FP4 values a byte, low nibble first) times
    2 ** (`scales` - 127) (uint8 [experts, out, groups]: one exponent per 32 values), as [experts, in,
    out] in `dtype`: the layout and arithmetic (each value from the table in `dtype`, then `ldexp`) of
    transformers' dequantization of gpt-oss's experts."""
    table = torch.tensor(FP4, dtype=dtype, device=blocks.device)
    *outer, groups, width = blocks.shape
    packed = blocks.reshape(-1, width)
    values = torch.empty(packed.shape[0], width * 2, dtype=dtype, device=blocks.device)
    values[:, 0::2] = table[(packed & 0x0F).to(torch.int)]
    values[:, 1::2] = table[(packed >> 4).to(torch.int)]
    torch.ldexp(values, scales.reshape(-1, 1).to(torch.int32) - 127, out=values)
    return values.reshape(*outer, groups * width * 2).transpose(1, 2).contiguous()


def _fp8_grid(values: TensorInfo, scale: TensorInfo) -> str | None:
    rows, cols = scale.shape[-2:] if len(scale.shape) >= 2 else (1, 1)
    if len(values.shape) < 2 or values.shape[-2] % rows or values.shape[-1] % cols:
        return "is not divided into whole blocks by its scale"
    if math.prod(scale.shape[:-2]) not in (1, math.prod(values.shape[:-2])):
        return "is not given one block grid, or one a matrix, by its scale"
    return None


def _mxfp4_grid(values: TensorInfo, scale: TensorInfo) -> str | None:
    if len(values.shape) != 4 or values.shape[:-1] != scale.shape:
        return "is not [experts, out, groups, bytes] with one exponent per group in its scale"
    return None


@dataclass(frozen=True)
class Format:
    """One way of storing a quantized tensor in parts (its values, its scale, more where the format
    has them): the stored names of a target's parts, the shape and check before reading, the computation."""

    parts: Callable[[str], tuple[str, ...]]  # target -> its stored parts: values, scale, then optional ones
    target: Callable[[str], str | None]  # a stored name -> the target it is the values of (None: not one)
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # the values' shape -> the target's
    compute: Callable[[list[torch.Tensor], torch.dtype], torch.Tensor]  # the parts, in `parts`' order
    grid: Callable[[TensorInfo, TensorInfo], str | None] = lambda values, scale: None  # what is wrong, before reading
    # the computed tensor's dtype whatever the parameter's, from its parts' (None: the parameter's)
    own_dtype: Callable[[list[TensorInfo]], torch.dtype | None] = lambda parts: None


# The computations of the methods that have one (`methods.METHODS` names them by `quant_method`)
FP8 = Format(
    parts=lambda t: (t, t + "_scale_inv"), target=lambda n: n, shape=lambda s: s,
    compute=lambda p, dtype: fp8_blocks(p[0], p[1], dtype), grid=_fp8_grid,
)  # fmt: skip
MXFP4 = Format(
    parts=lambda t: (t + "_blocks", t + "_scales"),
    target=lambda n: n.removesuffix("_blocks") if n.endswith("_blocks") else None,
    shape=lambda s: (s[0], s[2] * s[3] * 2, s[1]) if len(s) == 4 else s,
    compute=lambda p, dtype: mxfp4_blocks(p[0], p[1], dtype), grid=_mxfp4_grid,
    own_dtype=lambda parts: torch.bfloat16,
)  # fmt: skip


class Dequantization:
    """The checkpoint's quantized tensors of one `Format` (`pairs`: target -> its stored parts, values
    and scale first; a target is no stored name but its values')."""

    def __init__(self, fmt: Format, pairs: dict[str, tuple[str, ...]]) -> None:
        self.format = fmt
        self.pairs = pairs
        self.role = {s: (t, i) for t, parts in pairs.items() for i, s in enumerate(parts)}  # stored -> (target, i)
        self.names = set(self.role)  # every stored tensor it computes from (read as stored)
        self._waiting: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # targets of the format's own dtype (`check` finds them)

    @staticmethod
    def of(fmt: Format, names: Iterable[str]) -> Dequantization:
        """The targets `names` hold in a format (a method's, by its name: `methods.dequantization`): each
        whose values and scale are there, with the optional parts that are."""
        present = set(names)
        pairs: dict[str, tuple[str, ...]] = {}
        for target in sorted(t for n in present if (t := fmt.target(n)) is not None):
            values, scale, *optional = fmt.parts(target)
            if scale in present:
                pairs[target] = (values, scale, *(p for p in optional if p in present))
        return Dequantization(fmt, pairs)

    def check(self, tensors: Mapping[str, TensorInfo]) -> None:
        """Before a byte is read: each target's parts fit its format (whole blocks, one scale per
        group); the dtypes of targets the format computes into its own (`dtypes`)."""
        for target, parts in self.pairs.items():
            if (dtype := self.format.own_dtype([tensors[p] for p in parts])) is not None:
                self.dtypes[target] = dtype
            values, scale = parts[:2]
            if (wrong := self.format.grid(tensors[values], tensors[scale])) is not None:
                raise StreamloadError(
                    f"{tensors[values].path}: tensor {values!r} {list(tensors[values].shape)} {wrong} {scale!r} "
                    f"{list(tensors[scale].shape)}; nothing was read"
                )

    def shapes(self, tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
        """{name the model gets: its shape}: the stored tensors', each pair's by its computed target."""
        plain = {n: tuple(t.shape) for n, t in tensors.items() if n not in self.role}
        return plain | {t: self.format.shape(tuple(tensors[parts[0]].shape)) for t, parts in self.pairs.items()}

    def as_stored(self, dtype: DTypeOption) -> dict[str, Any]:
        """`dtype` (the load's option) with the pairs read as stored: computed, not cast."""
        return {**dict.fromkeys(self.names), **(dtype if isinstance(dtype, Mapping) else {"*": dtype})}

    def targets(self, names: Iterable[str]) -> list[str]:
        """The names the model gets from `names`: each pair's target once, the rest as they are."""
        roles = (self.role.get(n, (n, 0)) for n in names)
        return [target for target, which in roles if which == 0]

    def apply(
        self,
        tensors: dict[str, torch.Tensor],
        dtype_of: Callable[[str], torch.dtype],
        release: Callable[[torch.Tensor], None] = lambda part: None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A group's tensors (taken out of `tensors` as they go), each target whose parts are all in
        computed (in `dtype_of(target)` or the format's own dtype) in place of its parts, one at a time:
        the caller puts each away before the next is computed, so a group holds one computed tensor at
        a time, not all of them. A part whose partners are not in yet waits for them. Each part is
        given to `release` once computed (a `Release`: its file pages leave the process)."""
        for name in list(tensors):
            t = tensors.pop(name)
            if name not in self.role:
                yield name, t
                continue
            self._waiting[name] = t
            del t
            target = self.role[name][0]
            parts = self.pairs[target]
            if all(p in self._waiting for p in parts):
                dtype = self.dtypes.get(target) or dtype_of(target)
                stored = [self._waiting.pop(p) for p in parts]
                computed = self.format.compute(stored, dtype)
                for part in stored:
                    if part.untyped_storage().data_ptr() != computed.untyped_storage().data_ptr():
                        release(part)
                del stored
                yield target, computed

    def left(self) -> list[str]:
        """Parts whose partners never came (a load that included some parts of a target and not all)."""
        return sorted(self._waiting)
