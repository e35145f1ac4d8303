"""Time to first token from a cold start: transformers vs streamload, eager and compiled, sequential
and overlapped (see examples/first_token.py for what each mode does).

Every run is a fresh process, with the checkpoint evicted from the page cache and an empty
`TORCHINDUCTOR_CACHE_DIR`; the modes take turns so that drift on a noisy machine hits all alike.

    python bench/first_token.py --make /tmp/llama-first-token     # once: a ~1 GB Llama checkpoint
    python bench/first_token.py /tmp/llama-first-token --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from streamload.commands.bench import evict

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "first_token.py"
MODES = ("transformers", "streamload", "sequential", "overlapped")


def make(path: Path, hidden: int, ffn: int, layers: int, vocab: int = 32000) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         vocab_size=vocab, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="300MB")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path}: {layers} layers, {size / 1e9:.2f} GB")


def one(path: Path, mode: str, device: str) -> dict[str, float | int | str]:
    evict(str(f) for f in path.glob("*.safetensors"))
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, FIRST_TOKEN_T0=repr(time.time()))
        cmd = [sys.executable, str(EXAMPLE), str(path), "--mode", mode, "--device", device]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", type=Path, default=Path("/tmp/llama-first-token"))
    ap.add_argument("--make", type=Path, help="write a random Llama checkpoint here and exit")
    ap.add_argument("--hidden", type=int, default=1024, help="with --make (default: %(default)s)")
    ap.add_argument("--ffn", type=int, default=2816, help="with --make (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=16, help="with --make (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=32000, help="with --make (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="default: %(default)s")
    ap.add_argument("--device", default="cpu", help="default: %(default)s")
    ap.add_argument("--json", type=Path, help="also write every run here")
    args = ap.parse_args()
    if args.make:
        make(args.make, args.hidden, args.ffn, args.layers, args.vocab)
        return
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, float | int | str]]] = {m: [] for m in modes}
    for i in range(args.runs):
        for mode in modes:
            r = one(args.checkpoint, mode, args.device)
            runs[mode].append(r)
            print(f"run {i + 1} {mode}: first token at {r['first_token']:.2f} s", file=sys.stderr)
    tokens = {r["token"] for rs in runs.values() for r in rs}
    size = sum(f.stat().st_size for f in args.checkpoint.glob("*.safetensors"))
    print(f"{args.checkpoint} ({size / 1e9:.2f} GB), {args.device}, median of {args.runs} runs, s since process start")
    print("| mode | imported | weights in | compiled | first token | vs transformers | graphs compiled in generate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = statistics.median(float(r["first_token"]) for r in runs[modes[0]])
    for mode in modes:
        stages = ("imported", "weights", "compiled", "first_token")
        med = {k: statistics.median(float(r[k]) for r in runs[mode]) for k in stages}
        extra = max(int(r["compiled_in_generate"]) for r in runs[mode])
        print(f"| {mode} | {med['imported']:.2f} | {med['weights']:.2f} | {med['compiled']:.2f} | "
              f"{med['first_token']:.2f} | {med['first_token'] / base:.2f}x | {extra} |")  # fmt: skip
    print(f"first generated token identical in every run: {len(tokens) == 1}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if len(tokens) != 1:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
