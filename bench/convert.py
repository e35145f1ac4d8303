"""A mixture of experts through `from_pretrained`, converted while it streams: streamload against
transformers' own loader, side by side, each run in a fresh process, in each state the page cache may be in.

    python bench/convert.py /tmp/qwen3-moe-tiny --make                    # Qwen3-30B-A3B layout, tiny dims
    python bench/convert.py /tmp/qwen3-moe-1g --make --hidden 256 --moe 128  # the same layout, ~1.2 GB
    python bench/convert.py /tmp/qwen3-moe-tiny --runs 3 --modes warm evicted cold written

The states (each run is given its own): warm, the files read just before (their pages cached, clean);
evicted, the files' pages dropped (fsync, POSIX_FADV_DONTNEED); cold, the whole page cache dropped
(/proc/sys/vm/drop_caches, as root; skipped where it cannot be written); written, a copy of the
checkpoint written just before the run and loaded from there (pages cached and dirty, never read).

The checkpoint is transformers' own save of a Qwen3-MoE built from a config with the hub model's
layer and expert counts (48 layers x 128 experts: 18,867 tensors, experts one by one as on the hub).
Each run reports the seconds from the call to a ready model (imports done before, the model's own
modules included) and the peak RSS
above the process's after its imports; the table gives medians and streamload / transformers ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

RUN = """
import json, resource, sys, time
how, folder, reader, ring = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
import torch, transformers
import streamload
config = transformers.AutoConfig.from_pretrained(folder)  # transformers' lazy imports, before the clock:
transformers.AutoModelForCausalLM.from_config  # the config's and the model's modules (both loaders need them)
transformers.AutoModelForCausalLM._model_mapping[type(config)]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
start = time.perf_counter()
if how == "streamload":
    tuning = {"ring_bytes": ring} if ring else {}
    model = streamload.from_pretrained(folder, device="cpu", dtype=torch.bfloat16, reader=reader, **tuning)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak_extra": peak - base, "params": sum(p.numel() for p in model.parameters())}))
"""


def make(folder: Path, hidden: int, moe: int, layers: int, experts: int) -> None:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=hidden, moe_intermediate_size=moe, intermediate_size=3 * moe,
        num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, vocab_size=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder, max_shard_size="200MB")
    import streamload

    checkpoint = streamload.inspect(folder)
    print(f"wrote {folder}: {len(checkpoint.tensors)} tensors, {checkpoint.nbytes / 1e9:.2f} GB")


MODES = ("warm", "evicted", "cold", "written")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def prepare(mode: str, folder: Path, scratch: Path) -> Path:
    """The checkpoint's folder for one run in `mode` (see the module's docstring)."""
    files = sorted(folder.glob("*.safetensors"))
    if mode == "warm":
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    elif mode == "evicted":
        from streamload.commands.bench import evict

        evict([str(f) for f in files])
    elif mode == "cold":
        os.sync()
        DROP_CACHES.write_text("3\n")
    elif mode == "written":
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(folder, scratch)  # written, not flushed: the copy's pages are in the cache, dirty
        return scratch
    return folder


def run(how: str, folder: Path, mode: str = "warm", reader: str = "auto", ring: str = "") -> dict[str, float]:
    scratch = folder.with_name(folder.name + ".written")
    try:
        where = prepare(mode, folder, scratch)
        cmd = [sys.executable, "-c", RUN, how, str(where), reader, ring]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--make", action="store_true", help="write the checkpoint into FOLDER")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--moe", type=int, default=32, help="the experts' intermediate size")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reader", default="auto", help="streamload's reader (posix: a bounded ring, no file mapping)")
    ap.add_argument("--ring-bytes", default="", help="streamload's ring (default: from the machine)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    if args.make:
        make(args.folder, args.hidden, args.moe, args.layers, args.experts)
        return
    size = sum(f.stat().st_size for f in args.folder.glob("*.safetensors"))
    print(
        f"{args.folder}: {size / 1e9:.3f} GB; median of {args.runs}, fresh processes, alternating; reader {args.reader}"
    )
    print("| mode | streamload s | transformers s | ratio | streamload peak extra | transformers peak extra | "
          "streamload / checkpoint bytes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    run("streamload", args.folder, "warm", args.reader, args.ring_bytes)  # imports' files in the page cache
    for mode in args.modes:
        if mode == "cold" and not can_drop_caches():
            print(f"| cold | not measured: {DROP_CACHES} cannot be written here (needs root) | | | | | |")
            continue
        got: dict[str, list[dict[str, float]]] = {"streamload": [], "transformers": []}
        for _ in range(args.runs):
            for how in got:
                got[how].append(run(how, args.folder, mode, args.reader, args.ring_bytes))
        s = statistics.median(r["seconds"] for r in got["streamload"])
        t = statistics.median(r["seconds"] for r in got["transformers"])
        sm = statistics.median(r["peak_extra"] for r in got["streamload"])
        tm = statistics.median(r["peak_extra"] for r in got["transformers"])
        print(
            f"| {mode} | {s:.2f} | {t:.2f} | {s / t:.2f}x | {sm / 1e6:.0f} MB | {tm / 1e6:.0f} MB | {sm / size:.2f}x |"
        )


if __name__ == "__main__":
    main()
