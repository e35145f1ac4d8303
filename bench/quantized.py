"""An FP8 checkpoint (DeepSeek-V3's layout: float8_e4m3fn weights, a float32 scale per 128x128 block)
through `streamload.from_pretrained` against transformers' own `from_pretrained`, which on a machine
without a GPU dequantizes it to bfloat16 as it loads: fresh processes, each loader's modules imported
before the clock, warm page cache (and cold where the page cache can be dropped).

    python bench/quantized.py /tmp/fp8-llama --make            # ~1.1 GB: 16 layers, hidden 2048
    python bench/quantized.py /tmp/fp8-llama --runs 3 --modes warm cold
    python bench/quantized.py /tmp/fp8-llama --runs 3 --reader posix --ring-bytes 64MiB

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
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    saved = json.loads((folder / "config.json").read_text())
    saved["architectures"] = ["LlamaForCausalLM"]
    saved["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                    "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(saved))


def one(loader: str, folder: Path, options: dict[str, str]) -> dict[str, float]:
    """In a fresh process: one load, its seconds and the peak resident memory it added."""
    import transformers
    import transformers.models.llama.modeling_llama

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
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["warm"], choices=["warm", "cold"])
    ap.add_argument("--reader", default="", help="streamload's reader (posix: a bounded ring, no file mapping)")
    ap.add_argument("--ring-bytes", default="", help="streamload's ring (default: from the machine)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    options = {k: v for k, v in {"reader": args.reader, "ring_bytes": args.ring_bytes}.items() if v}
    if args.one:
        print(json.dumps(one(args.one, args.folder, options)))
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
