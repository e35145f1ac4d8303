"""Quantized weights computed into plain ones as their layer streams in: FP8 weights with a float32
scale per block (`weight_scale_inv`: DeepSeek-V3/R1, Qwen3-FP8), as transformers computes them where
it dequantizes (a machine without a GPU, or `dequantize=True`): the float8 values and their block's
scale multiplied in float32, then cast to the parameter's dtype.

A weight and its scale belong to one layer and arrive in its group; each pair is computed once both
are in (a weight whose scale comes in a later group waits for it), so memory is one layer's.

>>> import torch
>>> q = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(torch.float8_e4m3fn)
>>> fp8_blocks(q, torch.tensor([[0.5]]), torch.bfloat16).tolist()
[[0.5, 1.0], [1.5, 2.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .errors import StreamloadError

if TYPE_CHECKING:
    from .format import TensorInfo
    from .plan import DTypeOption

SCALE = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`


def fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` (float8, [..., rows, cols]) times the scale of each of its blocks (`scale`: [..., rows /
    block rows, cols / block cols]), in float32, cast to `dtype` (transformers' `Fp8Dequantize`)."""
    values = weight.to(torch.float32)
    rows, cols = values.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:] if scale.dim() >= 2 else (1, 1)  # whole blocks: `check`
    blocks = values.reshape(-1, scale_rows, rows // scale_rows, scale_cols, cols // scale_cols)
    scales = scale.to(torch.float32).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    return (blocks * scales).to(dtype).reshape(values.shape)


class Fp8Dequantization:
    """The checkpoint's FP8 weights and their scales (`pairs`: weight name -> scale name)."""

    def __init__(self, pairs: dict[str, str]) -> None:
        self.pairs = pairs
        self.scales = {s: w for w, s in pairs.items()}
        self._waiting: dict[str, torch.Tensor] = {}

    @staticmethod
    def of(names: Iterable[str]) -> Fp8Dequantization:
        present = set(names)
        return Fp8Dequantization({n: n + SCALE for n in sorted(present) if n + SCALE in present})

    @property
    def names(self) -> set[str]:
        """Every weight and scale it computes from (read as stored)."""
        return {*self.pairs, *self.scales}

    def check(self, tensors: Mapping[str, TensorInfo]) -> None:
        """Before a byte is read: each weight is divided into whole blocks by its scale's grid."""
        for weight, scale in self.pairs.items():
            shape, grid = tensors[weight].shape, tensors[scale].shape
            rows, cols = grid[-2:] if len(grid) >= 2 else (1, 1)
            if len(shape) < 2 or shape[-2] % rows or shape[-1] % cols:
                raise StreamloadError(
                    f"{tensors[weight].path}: tensor {weight!r} {list(shape)} is not divided into whole blocks by "
                    f"its scale {scale!r} {list(grid)}; nothing was read"
                )

    def as_stored(self, dtype: DTypeOption) -> dict[str, Any]:
        """`dtype` (the load's option) with the weights and scales read as stored: computed, not cast."""
        return {**dict.fromkeys(self.names), **(dtype if isinstance(dtype, Mapping) else {"*": dtype})}

    def targets(self, names: Iterable[str]) -> list[str]:
        """The names the model gets: the weights, not their scales."""
        return [n for n in names if n not in self.scales]

    def apply(
        self, tensors: dict[str, torch.Tensor], dtype_of: Callable[[str], torch.dtype]
    ) -> dict[str, torch.Tensor]:
        """A group's tensors with each weight whose scale is in computed into `dtype_of(weight)`, the
        scales taken out; a weight or scale whose partner is not in yet waits for it."""
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            weight = self.scales.get(name, name)
            if weight not in self.pairs:
                out[name] = t
                continue
            self._waiting[name] = t
            scale = self.pairs[weight]
            if weight in self._waiting and scale in self._waiting:
                out[weight] = fp8_blocks(self._waiting.pop(weight), self._waiting.pop(scale), dtype_of(weight))
        return out

    def left(self) -> list[str]:
        """Weights or scales whose partner never came (a load that included one and not the other)."""
        return sorted(self._waiting)
