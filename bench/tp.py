"""Tensor-parallel loading on one machine: per-rank bytes read and load time for N = 1, 2, 4.

Each rank is its own process in a gloo process group and loads its shard of the checkpoint with
Megatron-style rules (q/k/v/gate/up and the embeddings split on dim 0, o/down on dim 1, norms
replicated), from a cold page cache, touching every page of what it gets.

    python bench/make_checkpoint.py /tmp/streamload-bench
    python bench/tp.py /tmp/streamload-bench --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

import streamload
from streamload import ShardSpec
from streamload.bench import _touch, evict

RULES = {
    "*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0,
    "*.gate_proj.weight": 0, "*.up_proj.weight": 0,
    "*.o_proj.weight": 1, "*.down_proj.weight": 1,
    "*embed_tokens.weight": 0, "lm_head.weight": 0,
}  # fmt: skip


def rank_main(rank: int, world: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        dist.barrier()
        start = time.perf_counter()
        with streamload.iter(path, device="cpu", shard=ShardSpec(RULES)) as stream:
            kept = []
            for _name, t in stream:
                _touch(t)
                kept.append(t)
        seconds = time.perf_counter() - start
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"seconds": seconds, "bytes_read": stream.stats.bytes_read, "tensors": len(kept)})
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    files = [str(f.path) for f in streamload.inspect(args.path).files]
    total = sum(os.path.getsize(f) for f in files)
    print(f"{total / 1e9:.2f} GB, cold page cache, median of {args.runs} runs\n")
    print("| ranks | bytes read per rank (mean) | of checkpoint | slowest rank | GB/s, all ranks together |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        slowest, per_rank = [], []
        for _ in range(args.runs):
            evict(files)
            with tempfile.TemporaryDirectory() as out:
                mp.start_processes(rank_main, args=(world, args.path, out), nprocs=world, start_method="spawn")
                results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
            slowest.append(max(r["seconds"] for r in results))
            per_rank.append(statistics.mean(r["bytes_read"] for r in results))
        s, b = statistics.median(slowest), statistics.median(per_rank)
        print(f"| {world} | {b / 1e9:.3f} GB | {b / total:.0%} | {s:.3f} s | {b * world / s / 1e9:.2f} |")


if __name__ == "__main__":
    main()
