"""Mixture-of-experts checkpoints at their real tensor counts, with tiny dimensions: the names, layer
and expert counts and shard counts of the hub's checkpoints, each tensor a few KB, so that per-tensor
costs (headers, plans, dry runs, weight loaders) are what a load measures.

    python bench/moe.py /tmp/qwen3-moe --shape qwen3-moe       # Qwen3-30B-A3B: 18,867 tensors, 16 shards
    python bench/moe.py /tmp/deepseek-v3 --shape deepseek-v3   # DeepSeek-V3: MLA, 256+1 experts, 45,395 tensors
    python bench/vllm.py /tmp/qwen3-moe --runs 3 --modes warm cold --formats streamload,safetensors
    python bench/moe.py /tmp/qwen3-moe --core --runs 5         # iter/load against load_file, fresh processes

Written with safetensors' `save_file` under the hub's names (transformers 5 would fuse the experts),
with the config the hub's `config.json` has, its sizes shrunk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-moe": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
        "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 64, "moe_intermediate_size": 32,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 1024, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "shards": 16,
    },
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (bf16 layout; no multi-token-prediction layer)
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64, "v_head_dim": 32, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "vocab_size": 1024,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000, "moe_layer_freq": 1,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "shards": 163,
    },
}  # fmt: skip


def qwen3_moe(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, heads, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        names |= {p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                  p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                  p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}  # fmt: skip
        names[p + "mlp.gate.weight"] = (c["num_experts"], h)
        for e in range(c["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            m = c["moe_intermediate_size"]
            names |= {x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h), x + "down_proj.weight": (h, m)}
    names |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    return names


def deepseek_v3(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        a = p + "self_attn."
        names |= {a + "q_a_proj.weight": (c["q_lora_rank"], h), a + "q_a_layernorm.weight": (c["q_lora_rank"],),
                  a + "q_b_proj.weight": (heads * qk, c["q_lora_rank"]),
                  a + "kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
                  a + "kv_a_layernorm.weight": (c["kv_lora_rank"],),
                  a + "kv_b_proj.weight": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                  a + "o_proj.weight": (h, heads * c["v_head_dim"])}  # fmt: skip
        if i < c["first_k_dense_replace"]:
            f = c["intermediate_size"]
            names |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                      p + "mlp.down_proj.weight": (h, f)}  # fmt: skip
            continue
        m = c["moe_intermediate_size"]
        names |= {p + "mlp.gate.weight": (c["n_routed_experts"], h),
                  p + "mlp.gate.e_score_correction_bias": (c["n_routed_experts"],)}  # fmt: skip
        s = p + "mlp.shared_experts."
        shared = m * c["n_shared_experts"]
        names |= {s + "gate_proj.weight": (shared, h), s + "up_proj.weight": (shared, h),
                  s + "down_proj.weight": (h, shared)}  # fmt: skip
        for e in range(c["n_routed_experts"]):
            x = f"{p}mlp.experts.{e}."
            names |= {x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h), x + "down_proj.weight": (h, m)}
    names |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    return names


def make(folder: Path, shape: str, layers: int | None = None) -> int:
    """Write the checkpoint (random bf16, norms near 1) with an index, as the hub has it; its tensor count.
    `layers`: fewer layers than the real model (a smaller test), the same tensors per layer."""
    from safetensors.torch import save_file

    config = dict(SHAPES[shape])
    shards = config.pop("shards")
    if layers is not None:
        shards = max(1, shards * layers // config["num_hidden_layers"])
        config["num_hidden_layers"] = layers
    names = (qwen3_moe if shape == "qwen3-moe" else deepseek_v3)(config)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    items = list(names.items())
    per = -(-len(items) // shards)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        part = items[k * per : (k + 1) * per]
        if not part:
            continue
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for n, s in part:
            t = torch.randn(s, generator=g) * 0.05
            tensors[n] = (t + 1 if ("norm" in n or n.endswith("bias")) else t).to(torch.bfloat16)
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        weight_map |= {n: fname for n, _ in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({**config, "transformers_version": "4.51.0"}, indent=1))
    return len(names)


CORE = """
import sys, time, json
t0 = time.perf_counter()
how, folder = sys.argv[1], sys.argv[2]
import torch
from pathlib import Path
files = sorted(Path(folder).glob("*.safetensors"))
if how == "load_file":
    from safetensors.torch import load_file
    start = time.perf_counter()
    state = {}
    for f in files:
        state.update(load_file(f))
else:
    import streamload
    start = time.perf_counter()
    state = streamload.load(folder, device="cpu")
seconds = time.perf_counter() - start
touched = sum(int(t.view(-1)[-1:].float().sum()) for t in state.values())  # every tensor, one byte or so
print(json.dumps({"seconds": seconds, "tensors": len(state), "with_touch": time.perf_counter() - start}))
"""


def core(folder: Path, runs: int) -> None:
    """iter/load against load_file over the shards, warm, fresh processes taking turns."""
    from streamload.commands.bench import compile_streamload

    compile_streamload()
    got: dict[str, list[dict[str, float]]] = {"load_file": [], "streamload": []}
    for _ in range(runs):
        for how in got:
            out = subprocess.run([sys.executable, "-c", CORE, how, str(folder)], capture_output=True, text=True,
                                 check=True)  # fmt: skip
            got[how].append(json.loads(out.stdout.strip().splitlines()[-1]))
    n = got["load_file"][0]["tensors"]
    base = statistics.median(r["seconds"] for r in got["load_file"])
    print(f"{folder}: {n} tensors, warm, median of {runs} fresh processes\n")
    print("| loader | seconds | tensors/s | per tensor | x load_file |")
    print("|---|---|---|---|---|")
    for how, rs in got.items():
        s = statistics.median(r["seconds"] for r in rs)
        print(f"| {how} | {s:.3f} | {n / s:,.0f} | {s / n * 1e6:.1f} us | {s / base:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="write this checkpoint into FOLDER")
    ap.add_argument("--core", action="store_true", help="time streamload.load against load_file on FOLDER")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if args.shape:
        print(f"wrote {args.folder}: {args.shape}, {make(args.folder, args.shape)} tensors")
    if args.core:
        core(args.folder, args.runs)


if __name__ == "__main__":
    main()
