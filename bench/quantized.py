"""An FP8 checkpoint (DeepSeek-V3's layout: float8_e4m3fn weights, a float32 scale per 128x128 block)
through `streamload.from_pretrained` against transformers' own `from_pretrained`, which on a machine
without a GPU dequantizes it to bfloat16 as it loads: fresh processes, each loader's modules imported
before the clock, warm page cache, cold (every cache dropped, where it can be) or with only the
checkpoint's pages evicted.

    python bench/quantized.py /tmp/fp8-llama --make            # ~1.1 GB: 16 layers, hidden 2048
    python bench/quantized.py /tmp/fp8-llama --runs 3 --modes warm cold evicted
    python bench/quantized.py /tmp/fp8-llama --runs 3 --reader posix --ring-bytes 64MiB
    python bench/quantized.py /tmp/qwen3-30b-fp8-tiny --make --experts 128 --layers 48 --hidden 128 \
        --intermediate 128 --vocab 1024                       # Qwen3-30B-A3B-FP8's 48 x 128 experts, tiny
    python bench/quantized.py /tmp/fp8-moe --make --experts 32 --layers 16 --hidden 1024 --intermediate 512

Reported: seconds (median), the ratio to transformers', and the peak memory the load added over the
loaded model's bytes.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from streamload.commands.bench import evict

BLOCK = 128


def make(folder: Path, hidden: int, intermediate: int, layers: int, vocab: int) -> None:
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                                      vocab_size=vocab, tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden),
              "o_proj": (hidden, hidden), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}  # fmt: skip
    index: dict[str, str] = {}

    def shard(tensors: dict[str, torch.Tensor], k: int) -> None:
        name = f"model-{k:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    shard({"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)}, 0)
    for i in range(layers):
        tensors: dict[str, torch.Tensor] = {}
        p = f"model.layers.{i}."
        for name, (rows, cols) in shapes.items():
            where = p + ("mlp." if name in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + name + ".weight"
            tensors[where] = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[where + "_scale_inv"] = torch.rand(rows // BLOCK, cols // BLOCK, generator=g) / 1000
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        shard(tensors, i + 1)
    shard({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
           "lm_head.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)}, layers + 1)  # fmt: skip
    _index_and_config(folder, index, "LlamaForCausalLM")


def make_moe(folder: Path, hidden: int, intermediate: int, layers: int, vocab: int, experts: int) -> None:
    """Qwen3-30B-A3B-FP8's layout (its names, one tensor per expert, FP8 weights with 128x128 block scales,
    the router, norms, embeddings and head in bfloat16) at the sizes given: `intermediate` is each
    expert's, 8 experts a token, heads of 128 dimensions."""
    import transformers
    from safetensors.torch import save_file

    heads, kv = max(hidden // 128, 1), max(hidden // 512, 1)
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, num_experts=experts,
        num_experts_per_tok=min(8, experts), vocab_size=vocab, tie_word_embeddings=False, dtype="bfloat16",
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    index: dict[str, str] = {}

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return weight, torch.rand(-(-rows // BLOCK), -(-cols // BLOCK), generator=g) / 1000

    def shard(tensors: dict[str, torch.Tensor], k: int) -> None:
        name = f"model-{k:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    shard({"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)}, 0)
    shapes = {"self_attn.q_proj": (heads * 128, hidden), "self_attn.k_proj": (kv * 128, hidden),
              "self_attn.v_proj": (kv * 128, hidden), "self_attn.o_proj": (hidden, heads * 128)}  # fmt: skip
    for e in range(experts):
        expert = f"mlp.experts.{e}."
        shapes |= {expert + "gate_proj": (intermediate, hidden), expert + "up_proj": (intermediate, hidden),
                   expert + "down_proj": (hidden, intermediate)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors: dict[str, torch.Tensor] = {}
        for name, (rows, cols) in shapes.items():
            tensors[p + name + ".weight"], tensors[p + name + ".weight_scale_inv"] = fp8(rows, cols)
        tensors[p + "mlp.gate.weight"] = torch.randn(experts, hidden, generator=g).to(torch.bfloat16)
        for norm, size in (("input_layernorm", hidden), ("post_attention_layernorm", hidden),
                           ("self_attn.q_norm", 128), ("self_attn.k_norm", 128)):  # fmt: skip
            tensors[p + norm + ".weight"] = torch.ones(size, dtype=torch.bfloat16)
        shard(tensors, i + 1)
    shard({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
           "lm_head.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)}, layers + 1)  # fmt: skip
    _index_and_config(folder, index, "Qwen3MoeForCausalLM")


def _index_and_config(folder: Path, index: dict[str, str], architecture: str) -> None:
    """The shards' index, and the config as an FP8 block-quantized checkpoint's."""
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    saved = json.loads((folder / "config.json").read_text())
    saved["architectures"] = [architecture]
    saved["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                    "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(saved))


def one(loader: str, folder: Path, options: dict[str, str]) -> dict[str, float]:
    """In a fresh process: one load, its seconds and the peak resident memory it added."""
    import transformers
    import transformers.models.llama.modeling_llama
    import transformers.models.qwen3_moe.modeling_qwen3_moe

    import streamload
    import streamload.integrations.transformers

    before = _rss()
    started = time.perf_counter()
    if loader == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    else:
        model = streamload.from_pretrained(folder, device="cpu", **options)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    return {"seconds": seconds, "added": peak - before, "model_bytes": model_bytes}


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--make", action="store_true", help="write the checkpoint into FOLDER")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=0, help="with --make: Qwen3-MoE-FP8's layout, this many experts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["warm"], choices=["warm", "cold", "evicted"],
                    help="cold: every cache dropped (the libraries' pages too; needs root); "
                    "evicted: only the checkpoint's pages, as `streamload bench --cold`")  # fmt: skip
    ap.add_argument("--reader", default="", help="streamload's reader (posix: a bounded ring, no file mapping)")
    ap.add_argument("--ring-bytes", default="", help="streamload's ring (default: from the machine)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    options = {k: v for k, v in {"reader": args.reader, "ring_bytes": args.ring_bytes}.items() if v}
    if args.one:
        print(json.dumps(one(args.one, args.folder, options)))
        return
    if args.make and args.experts:
        make_moe(args.folder, args.hidden, args.intermediate, args.layers, args.vocab, args.experts)
        return
    if args.make:
        make(args.folder, args.hidden, args.intermediate, args.layers, args.vocab)
        return
    stored = sum(f.stat().st_size for f in args.folder.glob("*.safetensors"))
    print(f"{args.folder}: {stored / 1e9:.2f} GB of safetensors; {args.runs} runs a loader, alternating; "
          f"streamload's options: {options or 'defaults'}")  # fmt: skip
    for mode in args.modes:
        if mode == "cold" and not _drop_caches():
            print("cold: cannot drop the page cache here (needs root): skipped")
            continue
        runs: dict[str, list[dict[str, float]]] = {"transformers": [], "streamload": []}
        for _ in range(args.runs):
            for loader in runs:
                if mode == "cold":
                    _drop_caches()
                elif mode == "evicted":
                    evict(str(f) for f in args.folder.glob("*.safetensors"))
                argv = [sys.executable, __file__, str(args.folder), "--one", loader]
                argv += [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
                out = subprocess.run(argv, capture_output=True, text=True, check=True)
                runs[loader].append(json.loads(out.stdout.strip().splitlines()[-1]))
        base = statistics.median(r["seconds"] for r in runs["transformers"])
        print("| mode | loader | seconds (median) | x transformers | peak added / model bytes |")
        print("| --- | --- | --- | --- | --- |")
        for loader, rs in runs.items():
            seconds = statistics.median(r["seconds"] for r in rs)
            added = statistics.median(r["added"] / r["model_bytes"] for r in rs)
            print(f"| {mode} | {loader} | {seconds:.2f} | {seconds / base:.2f}x | {added:.2f}x |")


if __name__ == "__main__":
    main()
