"""A kernel vLLM's CPU build lacks, in plain torch, for the test engines only: FP8 linear layers with
block scales (DeepSeek-V3's, Qwen3-FP8's layout), where vLLM on this CPU finds no kernel ("Failed to
find a kernel that can implement the ScaledMM linear layer") and the engine cannot even be built.

Its arithmetic is the format's definition (each block's float8 values times the block's scale, then a
matmul), not vLLM's: the engines use it so that the weights vLLM's own loaders place can be compared
with streamload's (`check`) and both engines run; it says nothing of vLLM's GPU numerics. Nothing of
the weights' path is stubbed: vLLM's Fp8LinearMethod makes the parameters, its weight loaders fill them.
"""

from __future__ import annotations

from typing import Any

import torch


class BlockFp8Reference:
    """vLLM's kernel interface (`is_supported`, `can_implement`, `process_weights_after_loading`,
    `apply_weights`) for `weight` float8 [N, K] and `weight_scale_inv` float32 [N / bn, K / bk]."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def can_implement(cls, config: Any) -> tuple[bool, str]:
        return True, ""

    def __init__(self, config: Any) -> None:
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing: the parameters stay as loaded."""

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w, scale = layer.weight, layer.weight_scale_inv
        rows, cols = w.shape
        bn, bk = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
        full = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
        return torch.nn.functional.linear(x, (w.float() * full).to(x.dtype), bias)


def install() -> None:
    """vLLM's FP8 linear layers with block scales get `BlockFp8Reference` (offered as vLLM's own
    `force_kernel`; other FP8 layers choose as before). In the engines' process only."""
    from vllm.model_executor.layers.quantization import fp8

    original = fp8.init_fp8_linear_kernel

    def init_fp8_linear_kernel(*args: Any, **kwargs: Any) -> Any:
        if kwargs["activation_quant_key"].scale.group_shape.is_per_group():
            kwargs.setdefault("force_kernel", BlockFp8Reference)
        return original(*args, **kwargs)

    fp8.init_fp8_linear_kernel = init_fp8_linear_kernel
