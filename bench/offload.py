"""Tokens per second for a model larger than its memory budget: `streamload.offload` against
accelerate's offload (`device_map="auto"` with `max_memory`, the rest on disk or, on a GPU, the CPU),
and against the model loaded whole (the ceiling). Each run is a fresh process; modes take turns.

Per run: load (or prepare) the model, greedy `generate` of `--new` tokens after a `--prompt`-token
prompt, batch 1. Reported: seconds per decode pass (the tokens after the first), tokens/s, and for
streamload the time it waited for blocks; besides, "fetch only" (streaming the offloaded blocks once,
no compute) and "compute only" (a decode pass of the whole model) bound a pass from below.

    python bench/first_token.py --make /tmp/llama-offload --layers 32 --vocab 16000   # 1.6 GB Llama
    python bench/offload.py /tmp/llama-offload --budget-share 0.33 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("whole", "streamload", "streamload-posix", "accelerate")

CHILD = r"""
import json, os, sys, tempfile, time
import torch, transformers, streamload
path, mode, device = sys.argv[1:4]
budget, prompt, new = (int(x) for x in sys.argv[4:7])
config = transformers.AutoConfig.from_pretrained(path)
ids = (torch.arange(prompt)[None] % config.vocab_size).to(device)
mask = torch.ones_like(ids)
out = {"mode": mode}
handle = None
start = time.perf_counter()
if mode == "whole":
    model = streamload.from_pretrained(path, device=device)
elif mode.startswith("streamload"):
    reader = mode.partition("-")[2] or "auto"  # on the CPU, auto maps the page cache: no copy
    with streamload.empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    handle = streamload.offload(model, path, device=device, budget_bytes=budget, reader=reader)
elif mode == "accelerate":
    where = "cpu" if device == "cpu" else 0
    memory = {where: budget} if device == "cpu" else {0: budget, "cpu": 64 << 30}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory=memory, offload_folder=tempfile.mkdtemp()).eval()
out["ready_s"] = time.perf_counter() - start
stamps = []
class Clock(transformers.LogitsProcessor):
    def __call__(self, input_ids, scores):
        if device != "cpu":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return scores
with torch.no_grad():
    begin = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   logits_processor=[Clock()])
decode = [b - a for a, b in zip(stamps, stamps[1:])]
out["prefill_s"] = stamps[0] - begin
out["pass_s"] = sorted(decode)[len(decode) // 2]
if handle is not None:
    s = handle.stats
    out.update(waited_s=s.waited_s, fetches=s.fetches, peak_bytes=s.peak_bytes,
               offloaded_blocks=s.offloaded_blocks, resident_blocks=s.resident_blocks)
    names = [n for b in handle.blocks for n in b.names]
    t = time.perf_counter()
    for _ in streamload.iter(path, device=device, include=names, reader=reader):
        pass
    out["fetch_only_s"] = time.perf_counter() - t
    handle.close()
if mode == "whole":
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        step = ids[:, -1:]
        times = []
        for _ in range(5):
            t = time.perf_counter()
            model(step, past_key_values=past, use_cache=True)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    out["compute_only_s"] = sorted(times)[2]
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--budget-share", type=float, default=0.33, help="budget / checkpoint size (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="default: %(default)s")
    ap.add_argument("--runs", type=int, default=3, help="default: %(default)s")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--new", type=int, default=8, help="generated tokens (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="default: %(default)s")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import streamload

    total = streamload.inspect(args.checkpoint).nbytes
    budget = int(total * args.budget_share)
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.runs):
        for mode in modes:
            cmd = [sys.executable, "-c", CHILD, str(args.checkpoint), mode, args.device, str(budget),
                   str(args.prompt), str(args.new)]  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp:
                done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TMPDIR=tmp))
            if done.returncode:
                print(f"run {r + 1} {mode} failed: {done.stderr.strip().splitlines()[-1]}", file=sys.stderr)
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            runs[mode].append(got)
            print(f"run {r + 1} {mode}: {got['pass_s'] * 1e3:.0f} ms per decode pass", file=sys.stderr, flush=True)

    def med(mode: str, key: str) -> float | None:
        values = [x[key] for x in runs.get(mode, []) if key in x]
        return statistics.median(values) if values else None

    base = med("accelerate", "pass_s")
    print(f"{args.checkpoint}: {total / 1e9:.2f} GB, budget {budget / 1e9:.2f} GB ({total / budget:.1f}x smaller), "
          f"{args.device}, median of {args.runs} runs, {args.prompt}-token prompt, {args.new} new tokens")  # fmt: skip
    print("| mode | ready | prefill | per decode pass | tokens/s | x accelerate | waited for blocks |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        p = med(mode, "pass_s")
        if p is None:
            print(f"| {mode} | failed | | | | | |")
            continue
        waited = med(mode, "waited_s")
        print(f"| {mode} | {med(mode, 'ready_s'):.2f} s | {med(mode, 'prefill_s'):.2f} s | {p * 1e3:.0f} ms | "
              f"{1 / p:.2f} | {'-' if base is None else format(base / p, '.2f') + 'x'} | "
              f"{'-' if waited is None else format(waited, '.2f') + ' s'} |")  # fmt: skip
    compute = med("whole", "compute_only_s")
    if compute is not None:
        print(f"\ncompute only: {compute * 1e3:.0f} ms (a decode pass of the whole model)")
    for mode in (m for m in modes if m.startswith("streamload")):
        fetch = med(mode, "fetch_only_s")
        if fetch is not None:
            print(f"fetch only, {mode}: {fetch * 1e3:.0f} ms (the offloaded blocks streamed once, no compute)")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
