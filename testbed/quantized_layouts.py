"""Quantized checkpoints in the layouts their tools write (tensor names, dtypes, shapes, packing and
`quantization_config`), made from a small Llama: compressed-tensors (W8A8 int8 by channel and by
tensor, FP8 by channel, W4A16 packed by group and by channel, W4A8), FP8 with block scales
(DeepSeek-V3's), GPTQ (with and without `g_idx`) and AutoAWQ (GEMM). The head and embeddings stay
unquantized, as such checkpoints keep them. `make_moe`: mixtures of experts (Qwen3-MoE in compressed-tensors
W4A16 and FP8 with block scales, gpt-oss in MXFP4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

GROUP = 32  # input columns a group scale covers
FP8_BLOCK = 32  # rows and columns an FP8 block scale covers (DeepSeek-V3's are 128: these models are small)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's interleave: nibble i of a word holds column ORDER[i] of its 8


def pack_int4(q: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values (0..15) an int32 along `dim`; nibble i of each word holds value `order[i]`."""
    q = q.movedim(dim, -1).to(torch.int32)
    q = q.reshape(*q.shape[:-1], -1, 8)
    packed = torch.zeros(q.shape[:-1], dtype=torch.int32)
    for i, k in enumerate(order):
        packed |= (q[..., k] & 0xF) << (4 * i)
    return packed.movedim(-1, dim).contiguous()


def symmetric(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [out, in] as integers in [-2^(bits-1), 2^(bits-1) - 1] and their scales, one per output row and
    `group` input columns ([out, in / group]; [out, 1] for a scale per channel)."""
    top = 2 ** (bits - 1) - 1
    blocks = w.reshape(w.shape[0], -1, w.shape[1] if group is None else group)
    scale = blocks.abs().amax(dim=2, keepdim=True).clamp(min=1e-8) / top
    q = (blocks / scale).round().clamp(-top - 1, top)
    return q.reshape(w.shape).to(torch.int32), scale.squeeze(2)


def _compressed(w: torch.Tensor, base: str, layout: str) -> dict[str, torch.Tensor]:
    if layout in ("w8a8-int8", "w8a8-int8-tensor", "fp8-channel"):
        top = 448.0 if layout == "fp8-channel" else 127.0
        per_tensor = layout == "w8a8-int8-tensor"
        scale = w.abs().amax().reshape(1) / top if per_tensor else w.abs().amax(dim=1, keepdim=True) / top
        q = w / scale
        q = q.to(torch.float8_e4m3fn) if layout == "fp8-channel" else q.round().clamp(-128, 127).to(torch.int8)
        return {base + "weight": q, base + "weight_scale": scale.to(torch.float32)}
    if layout in ("w4a16-group", "w4a16-channel"):  # pack-quantized: 4-bit values + 8, eight an int32 along rows
        q, scale = symmetric(w, 4, GROUP if layout == "w4a16-group" else None)
        return {base + "weight_packed": pack_int4(q + 8, 1), base + "weight_scale": scale.to(torch.bfloat16),
                base + "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}  # fmt: skip
    if layout == "fp8-block":  # DeepSeek-V3's: float8_e4m3fn, a float32 `weight_scale_inv` per block
        rows, cols = w.shape
        blocks = w.reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        return {base + "weight": q, base + "weight_scale_inv": scale.to(torch.float32)}
    if layout == "w4a8":  # int-quantized: 4-bit values stored one an int8
        q, scale = symmetric(w, 4, GROUP)
        return {base + "weight": q.to(torch.int8), base + "weight_scale": scale.to(torch.float32)}
    raise ValueError(layout)


def _gptq_or_awq(w: torch.Tensor, base: str, layout: str) -> dict[str, torch.Tensor]:
    """GPTQ: `qweight` [in / 8, out] packed along the input, `qzeros` (stored minus one, GPTQ's v1 format)
    [in / G, out / 8], `scales` [in / G, out] float16, `g_idx` [in]; AWQ: `qweight` [in, out / 8] and
    `qzeros` packed along the output in AWQ's interleaved order."""
    q, scale = symmetric(w, 4, GROUP)
    unsigned, scales = (q + 8).T, scale.T.to(torch.float16).contiguous()
    if layout == "awq":
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
        return {base + "qweight": pack_int4(unsigned, 1, AWQ_ORDER), base + "qzeros": pack_int4(zeros, 1, AWQ_ORDER),
                base + "scales": scales}  # fmt: skip
    zeros = torch.full_like(scales, 7, dtype=torch.int32)
    out = {base + "qweight": pack_int4(unsigned, 0), base + "qzeros": pack_int4(zeros, 1), base + "scales": scales}
    if layout == "gptq-g-idx":
        out[base + "g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
    return out


def _scheme(weights: dict[str, Any], activations: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    scheme: dict[str, Any] = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights}}
    if activations:
        scheme["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": scheme},
            "ignore": ["lm_head"], "quantization_status": "compressed"}  # fmt: skip


_FP8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
_INT4_GROUP = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP}
_FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}  # fmt: skip
_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq"}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "w8a8-int8": _scheme({"num_bits": 8, "type": "int", "strategy": "channel"}, _TOKEN, "int-quantized"),
    "w8a8-int8-tensor": _scheme({"num_bits": 8, "type": "int", "strategy": "tensor"}, _TOKEN, "int-quantized"),
    "fp8-channel": _scheme(_FP8, _TOKEN | {"type": "float"}, "float-quantized"),
    "w4a16-group": _scheme(_INT4_GROUP, None, "pack-quantized"),
    "w4a16-channel": _scheme({"num_bits": 4, "type": "int", "strategy": "channel"}, None, "pack-quantized"),
    "w4a8": _scheme(_INT4_GROUP, _TOKEN, "int-quantized"),
    "fp8-block": _FP8_BLOCK,
    "gptq": _GPTQ,
    "gptq-g-idx": _GPTQ,
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
}
GPTQ_OR_AWQ = {"gptq", "gptq-g-idx", "awq"}  # (vLLM runs these in float16 or bfloat16 only)


def quantized(key: str, w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """The tensors `layout` stores for the linear weight `key` ([out, in])."""
    base = key.removesuffix("weight")
    return _gptq_or_awq(w, base, layout) if layout in GPTQ_OR_AWQ else _compressed(w, base, layout)


def make(root: Path, small: dict[str, Any], layouts: list[str] | None = None, seed: int = 30) -> dict[str, Path]:
    """A Llama of `small`'s sizes, randomly initialised from `seed`, in each of `layouts` (default: all)
    as a folder under `root` with two shards and an index, as such checkpoints ship."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    plain = root / f"llama-to-quantize-{seed}"
    model.save_pretrained(plain)
    state = model.state_dict()
    config = json.loads((plain / "config.json").read_text())
    paths = {}
    for layout in layouts or list(CONFIGS):
        tensors: dict[str, torch.Tensor] = {}
        for key, w in state.items():
            is_linear = ".layers." in key and key.endswith("_proj.weight")
            tensors |= quantized(key, w, layout) if is_linear else {key: w.contiguous()}
        folder = root / f"{layout}-{seed}"
        folder.mkdir()
        names = sorted(tensors)
        index: dict[str, str] = {}
        for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            file = f"model-{k + 1:05d}-of-00002.safetensors"
            save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
            index |= dict.fromkeys(part, file)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        (folder / "config.json").write_text(json.dumps(config | {"quantization_config": CONFIGS[layout]}))
        paths[layout] = folder
    return paths


# Mixtures of experts, in the layouts their hub checkpoints have: Qwen3-MoE (Qwen3-30B-A3B's names, each
# expert's gate, up and down projections stored one by one) as compressed-tensors W4A16 packs it
# (RedHatAI's `quantized.w4a16`: the router gate and the head unquantized) and as FP8 with block scales
# (Qwen3-30B-A3B-FP8's, DeepSeek-V3's); gpt-oss in MXFP4 as OpenAI ships it (each layer's experts fused:
# `gate_up_proj_blocks` [E, 2I, H / 32, 16] uint8, two FP4 values a byte, `gate_up_proj_scales` [E, 2I,
# H / 32] uint8 exponents, gate and up rows interleaved; attention, router, embeddings and head in bf16).
MOE = {"hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
       "num_experts_per_tok": 2, "vocab_size": 300, "max_position_embeddings": 256}  # fmt: skip
_ROUTERS = [f"model.layers.{i}.mlp.gate" for i in range(MOE["num_hidden_layers"])]  # kept in bf16, as the hub's
_GPT_OSS_BF16 = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "moe-w4a16-group": CONFIGS["w4a16-group"] | {"ignore": ["lm_head", "re:.*mlp.gate$"]},
    "moe-fp8-block": _FP8_BLOCK | {"modules_to_not_convert": ["lm_head", *_ROUTERS]},
    "gpt-oss-mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": _GPT_OSS_BF16},
}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 codes


def _qwen3_moe(c: dict[str, Any], g: torch.Generator) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's tensors under the hub's names, float32, random (norms near 1)."""
    h, heads, kv, hd, m = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "moe_intermediate_size"))  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate.weight": (c["num_experts"], h)}  # fmt: skip
        for e in range(c["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            shapes |= {x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h), x + "down_proj.weight": (h, m)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    return {n: torch.randn(s, generator=g) * 0.2 + (1.0 if "norm" in n else 0.0) for n, s in shapes.items()}


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [..., K] as MXFP4 (OCP MX): per 32 values along K, a power-of-two scale (uint8 exponent, bias 127)
    and E2M1 codes, two a byte (the low nibble first): blocks [..., K / 32, 16] and scales [..., K / 32]."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp(min=2**-100))) - 2  # max -> [4, 8)
    values = torch.tensor(FP4_VALUES)
    codes = (blocks / 2.0**exponent).unsqueeze(-1).sub(values).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def _gpt_oss_mxfp4(c: dict[str, Any], g: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import transformers

    config = transformers.GptOssConfig(**{k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")},
        intermediate_size=c["intermediate_size"], num_local_experts=c["num_experts"],
        num_experts_per_tok=c["num_experts_per_tok"], sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)  # fmt: skip
    h, heads, kv, hd, n, e = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "intermediate_size", "num_experts"))  # fmt: skip
    out: dict[str, torch.Tensor] = {}

    def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.2 + mean).to(torch.bfloat16)

    out["model.embed_tokens.weight"] = rand(c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": rand(h, mean=1.0), p + "self_attn.sinks": rand(heads),
                p + "post_attention_layernorm.weight": rand(h, mean=1.0)}  # fmt: skip
        for proj, rows, cols in (("q", heads * hd, h), ("k", kv * hd, h), ("v", kv * hd, h), ("o", h, heads * hd)):
            out |= {f"{p}self_attn.{proj}_proj.weight": rand(rows, cols), f"{p}self_attn.{proj}_proj.bias": rand(rows)}
        out |= {p + "mlp.router.weight": rand(e, h), p + "mlp.router.bias": rand(e)}
        x = p + "mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * n, h), ("down_proj", h, n)):
            blocks, scales = mxfp4(torch.randn(e, rows, cols, generator=g) * 0.2)
            out |= {f"{x}{name}_blocks": blocks, f"{x}{name}_scales": scales, f"{x}{name}_bias": rand(e, rows)}
    out |= {"model.norm.weight": rand(h, mean=1.0), "lm_head.weight": rand(c["vocab_size"], h)}
    return out, config.to_dict() | {"architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16"}


def make_moe(root: Path, layouts: list[str] | None = None, seed: int = 40) -> dict[str, Path]:
    """A small mixture of experts (`MOE`'s sizes, random from `seed`) in each of `layouts` (default: all of
    `MOE_CONFIGS`) as a folder under `root` with two shards and an index."""
    paths = {}
    for layout in layouts or list(MOE_CONFIGS):
        g = torch.Generator().manual_seed(seed)
        if layout == "gpt-oss-mxfp4":
            tensors, config = _gpt_oss_mxfp4(MOE, g)
        else:
            config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rms_norm_eps": 1e-6,
                      "rope_theta": 1e6, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16", **MOE}  # fmt: skip
            tensors = {}
            for key, w in _qwen3_moe(MOE, g).items():
                if ".layers." in key and key.endswith("_proj.weight"):
                    tensors |= quantized(key, w, layout.removeprefix("moe-"))
                else:
                    tensors[key] = w.to(torch.bfloat16)
        _save(root / f"{layout}-{seed}", tensors, config | {"quantization_config": MOE_CONFIGS[layout]})
        paths[layout] = root / f"{layout}-{seed}"
    return paths


def _save(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    names = sorted(tensors)
    index: dict[str, str] = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / file), metadata={"format": "pt"})
        index |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(config))
