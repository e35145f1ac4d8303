"""Kernels vLLM's CPU build lacks, in plain torch, for the test engines only:

- FP8 linear layers with block scales (DeepSeek-V3's, Qwen3-FP8's layout), where vLLM on this CPU finds
  no kernel ("Failed to find a kernel that can implement the ScaledMM linear layer");
- 4-bit linear layers (compressed-tensors W4A16 symmetric, GPTQ, AWQ), whose CPU kernel vLLM chooses
  but whose op (`torch.ops._C.cpu_gemm_wna16`) some builds lack and others run only for some dtypes
  on some CPUs: the engine builds, its forward fails; the reference replaces it on every machine;
- mixtures of experts in compressed-tensors W4A16 ("No WNA16 MoE backend supports the deployment
  configuration"), FP8 with block scales (vLLM's oracle leaves `Fp8MoeBackend.NONE`, to an out-of-tree
  plugin, and then fails converting the weights for it) and gpt-oss's MXFP4 ("No MXFP4 MoE backend ...").

Without them the engine cannot be built, or not run. Their arithmetic is the format's definition (each block's
values times its scale, then matmuls), not vLLM's: the engines use them so that the weights vLLM's own
loaders place can be compared with streamload's (`check`) and both engines run; they say nothing of
vLLM's GPU numerics. Nothing of the weights' path is stubbed: vLLM's quantization methods make the
parameters (`create_weights`), its weight loaders fill them. Only the choice of a kernel is replaced,
and for the experts what vLLM does with the weights once loaded (`process_weights_after_loading`, a
repacking for the kernel chosen) and the forward (`apply`).
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


class PackedInt4Reference:
    """vLLM's mixed-precision kernel interface (`process_weights_after_loading`, `apply_weights`) for 4-bit
    linear layers: compressed-tensors W4A16, symmetric (pack-quantized `weight_packed` [N, K / 8] int32 and
    `weight_scale` [N, K / group]), and GPTQ's layout (`qweight` [K / 8, N], `scales` [K / group, N];
    with zero points `qzeros` [N / 8, K / group] packed along the output, as vLLM converts AWQ's; vLLM
    0.32 makes no `g_idx` parameter),
    which AWQ's checkpoints are converted into after loading: this CPU build chooses `CPUWNA16LinearKernel`, whose op
    (`cpu_gemm_wna16`) it was built without."""

    def __init__(
        self, config: Any, w_q_param_name: str, w_s_param_name: str, w_zp_param_name: str | None = None, **names: Any
    ) -> None:
        self.config, self.w_q_name, self.w_s_name = config, w_q_param_name, w_s_param_name
        self.w_zp_name = w_zp_param_name

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing: the parameters stay as loaded."""

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
        k, n = self.config.partition_weight_shape
        if tuple(packed.shape) == (k // 8, n):  # GPTQ's layout: packed along the input, scales [K / group, N]
            zeros = getattr(layer, self.w_zp_name) if self.config.zero_points and self.w_zp_name else None
            w = _gptq_int4(packed, scale, zeros)
        else:
            w = _packed_int4(packed, scale)
        return torch.nn.functional.linear(x, w.to(x.dtype), bias)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words as their eight 4-bit values along `dim` (value i in bits 4i..4i+3)."""
    values = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], dim=dim + 1)
    return values.flatten(dim, dim + 1)


def _gptq_int4(packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """GPTQ's [K / 8, N] 4-bit values minus their group's zero point (8 without zero points, GPTQ's
    symmetric `uint4b8`) times the group's scale, as [N, K]."""
    values = _nibbles(packed, 0)  # [K, N]
    group = torch.arange(values.shape[0]) // (values.shape[0] // scale.shape[0])
    zero = _nibbles(zeros, 0).T[group] if zeros is not None else 8  # [N / 8, K / group] -> [K, N]
    return ((values - zero).float() * scale.float()[group]).T


def _fp8_block(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K] float8 times its [E, N / bn, K / bk] block scales (the last blocks may be partial)."""
    rows, cols = w.shape[-2:]
    bn, bk = -(-rows // scale.shape[-2]), -(-cols // scale.shape[-1])
    full = scale.repeat_interleave(bn, -2)[..., :rows, :].repeat_interleave(bk, -1)[..., :cols]
    return w.float() * full


def _packed_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized, symmetric: [E, N, K / 8] int32, eight 4-bit values a word (value
    i in bits 4i..4i+3), each stored plus 8; times [E, N, K / group] scales."""
    nibbles = _nibbles(packed, packed.dim() - 1)
    group = nibbles.shape[-1] // scale.shape[-1]
    return (nibbles - 8).float() * scale.float().repeat_interleave(group, -1)


FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 codes


def _mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4: [E, N, K / 2] uint8, two E2M1 codes a byte (the low nibble first); per 32 values a uint8
    power-of-two exponent (bias 127) in [E, N, K / 32]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(FP4)[codes]
    return values * torch.exp2(scale.float() - 127).repeat_interleave(32, -1)


# Each quantization's experts, as the layer holds them after load_weights: (w13, w2) in float32, [E, 2I, H]
# and [E, H, I].
def _ct_wna16_experts(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return (_packed_int4(layer.w13_weight_packed, layer.w13_weight_scale),
            _packed_int4(layer.w2_weight_packed, layer.w2_weight_scale))  # fmt: skip


def _fp8_experts(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    w13, w2 = layer.w13_weight, layer.w2_weight
    return _fp8_block(w13, layer.w13_weight_scale_inv), _fp8_block(w2, layer.w2_weight_scale_inv)


def _mxfp4_experts(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return _mxfp4(layer.w13_weight, layer.w13_weight_scale), _mxfp4(layer.w2_weight, layer.w2_weight_scale)


def reference_moe(layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The mixture of experts by its definition: each token through its top-k experts (w13, the gated
    activation, w2, biases where the layer has them), weighted by the router and summed, in float32.
    This rank's part: at TP>1 vLLM's runner all-reduces it (as it does where no kernel reduced)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    w13, w2 = experts
    b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
    config = layer.moe_config
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        tokens, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = x[tokens].float() @ w13[e].T + (0 if b13 is None else b13[e].float())
        if layer.activation == MoEActivation.SILU:  # [gate; up]
            gate, up = h.chunk(2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
        elif layer.activation == MoEActivation.SWIGLUOAI:  # gate and up interleaved (gpt-oss)
            limit = config.swiglu_limit or 7.0
            alpha = config.swiglu_alpha or 1.702
            gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
            a = (up + 1) * gate * torch.sigmoid(gate * alpha)
        else:
            raise NotImplementedError(f"reference MoE: activation {layer.activation}")
        y = a @ w2[e].T + (0 if b2 is None else b2[e].float())
        out.index_add_(0, tokens, y * topk_weights[tokens, slot, None].float())
    return out.to(x.dtype)


def _reference_experts(cls: type, experts: Any) -> None:
    """`cls` (a vLLM MoE quantization method) on the reference forward where vLLM chose no kernel
    (`experts_cls` None): its weights stay as `load_weights` left them, `apply` runs `reference_moe`."""
    if getattr(cls, "reference_experts", None):
        return
    original_process, original_apply = cls.process_weights_after_loading, cls.apply
    original_config, monolithic = cls.get_fused_moe_quant_config, cls.is_monolithic

    def no_kernel(self: Any) -> bool:
        return self.experts_cls is None

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        if not no_kernel(self):
            original_process(self, layer)

    def apply(self: Any, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if no_kernel(self):
            return reference_moe(layer, x, topk_weights, topk_ids, experts(layer))
        return original_apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs)

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply
    cls.get_fused_moe_quant_config = lambda self, layer: None if no_kernel(self) else original_config(self, layer)
    cls.is_monolithic = property(lambda self: False if no_kernel(self) else monolithic.fget(self))
    cls.reference_experts = True


def _no_kernel(select: Any, none: Any = None) -> Any:
    """vLLM's MoE backend oracle `select`, answering (`none`, None) where it finds no kernel here."""

    def selected(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        try:
            backend, experts_cls = select(*args, **kwargs)
        except NotImplementedError:  # "No ... MoE backend supports the deployment configuration."
            return none, None
        return (backend, experts_cls) if experts_cls is not None else (none or backend, None)

    selected.reference_experts = True  # type: ignore[attr-defined]
    return selected if not getattr(select, "reference_experts", False) else select


def install_moe() -> None:
    """vLLM's MoE quantization methods that find no kernel on this CPU run `reference_moe`: compressed-
    tensors W4A16 (symmetric), FP8 with block scales, gpt-oss's MXFP4 (other MoE layers choose as before).
    Their `__init__` and `create_weights` are vLLM's, and so are the weight loaders that fill them."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization import fp8, mxfp4
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )

    wna16.select_wna16_moe_backend = _no_kernel(wna16.select_wna16_moe_backend)
    fp8.select_fp8_moe_backend = _no_kernel(fp8.select_fp8_moe_backend)
    mxfp4.select_mxfp4_moe_backend = _no_kernel(mxfp4.select_mxfp4_moe_backend, Mxfp4MoeBackend.NONE)
    _reference_experts(wna16.CompressedTensorsWNA16MoEMethod, _ct_wna16_experts)
    _reference_experts(fp8.Fp8MoEMethod, _fp8_experts)
    _reference_experts(mxfp4.GptOssMxfp4MoEMethod, _mxfp4_experts)


def install() -> None:
    """vLLM's FP8 linear layers with block scales get `BlockFp8Reference` (offered as vLLM's own
    `force_kernel`; other FP8 layers choose as before); 4-bit linear layers (compressed-tensors W4A16, GPTQ,
    AWQ), `PackedInt4Reference` where vLLM chose its CPU kernel; MoE layers without
    a kernel, `reference_moe` (`install_moe`); every kernel chosen as on a CPU without AMX (`without_amx`). In the
    engines' process only (and their forked ranks:
    tests/vllm_engines.py's `_worker`)."""
    from vllm.model_executor.layers.quantization import auto_awq, auto_gptq, fp8
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16 as wna16

    without_amx()
    install_moe()
    for module in (wna16, auto_gptq, auto_awq):  # each imported the chooser under its own name
        if getattr(module.choose_mp_linear_kernel, "reference", False):
            continue
        module.choose_mp_linear_kernel = _int4_reference(module.choose_mp_linear_kernel)

    original = fp8.init_fp8_linear_kernel

    def init_fp8_linear_kernel(*args: Any, **kwargs: Any) -> Any:
        if kwargs["activation_quant_key"].scale.group_shape.is_per_group():
            kwargs.setdefault("force_kernel", BlockFp8Reference)
        return original(*args, **kwargs)

    fp8.init_fp8_linear_kernel = init_fp8_linear_kernel


def without_amx() -> None:
    """vLLM's kernels chosen as on a CPU without AMX tiles, whatever this one has: where it has them, vLLM
    picks AMX kernels that run bfloat16 activations and DeepSeek's own sizes only (W8A8 int8's
    `int8_scaled_mm_with_quant`: "expect A to be bfloat16 or half"; MLA attention: "invalid weight
    input features 16"), and the test engines run float32 models of their own sizes. vLLM asks torch at
    each choice (`torch.cpu._is_amx_tile_supported()`), so answering no here reaches every one."""
    torch.cpu._is_amx_tile_supported = lambda: False  # type: ignore[attr-defined]
    torch.cpu._is_amx_fp16_supported = lambda: False  # type: ignore[attr-defined]


def _int4_reference(choose: Any) -> Any:
    """vLLM's kernel chooser, with `PackedInt4Reference` where it chose its CPU kernel for a 4-bit layer:
    symmetric (`uint4b8`) or with zero points (`uint4`, AWQ's)."""

    def choose_mp_linear_kernel(config: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = choose(config, *args, **kwargs)
        # vLLM's CPU kernel: its op is missing from some builds, and where present runs only some dtypes on
        # some CPUs ("cpu_gemm_wna16" not implemented for 'Float' on AVX512): the reference on every machine
        built_without = kernel.__name__ == "CPUWNA16LinearKernel"
        four_bits = str(config.weight_type) == "uint4b8" and not config.zero_points
        four_bits = four_bits or (str(config.weight_type) == "uint4" and config.zero_points)
        return PackedInt4Reference if built_without and four_bits else kernel

    choose_mp_linear_kernel.reference = True  # type: ignore[attr-defined]
    return choose_mp_linear_kernel
