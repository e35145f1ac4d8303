"""Tensor-parallel loading on one machine: per-rank bytes read and load time for N = 1, 2, 4.

Each rank is its own process in a gloo process group and loads its shard of the checkpoint with
Megatron-style rules (q/k/v/gate/up and the embeddings split on dim 0, o/down on dim 1, norms
replicated), from a cold page cache, touching every page of what it gets: first each rank alone
(every rank reads what it keeps, replicated tensors included), then cooperatively (ranks divide the
reads of what several of them need whole and all-gather it), alternating run by run. With --verify,
each mode also with verify=True (per-tensor digests, written first if the folder has none): every
byte a rank hands out checked, the digest blocks its slices cut completed from the file.

    python bench/make_checkpoint.py /tmp/streamload-bench
    python bench/tp.py /tmp/streamload-bench --runs 3 [--verify]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import streamload
import streamload.pipeline.verify
from streamload import ShardSpec
from streamload.commands.bench import evict
from streamload.commands.bench import touch as _touch
from streamload.cooperative.group import all_gather

RULES = {
    "*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0,
    "*.gate_proj.weight": 0, "*.up_proj.weight": 0,
    "*.o_proj.weight": 1, "*.down_proj.weight": 1,
    "*embed_tokens.weight": 0, "lm_head.weight": 0,
}  # fmt: skip


def rank_main(rank: int, world: int, path: str, out: str, mode: tuple[bool, bool]) -> None:
    cooperative, verify = mode
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        dist.barrier()
        start = time.perf_counter()
        with streamload.iter(path, device="cpu", shard=ShardSpec(RULES), cooperative=cooperative,
                             verify=verify) as stream:  # fmt: skip
            kept = []
            for _name, t in stream:
                _touch(t)
                kept.append(t)
        seconds = time.perf_counter() - start
        Path(out, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "seconds": seconds,
                    "bytes_read": stream.stats.bytes_read,
                    "tensors": len(kept),
                    "bytes_verified": stream.stats.bytes_verified,
                }
            )
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def exchange_main(rank: int, world: int, out: str, slot_bytes: int) -> None:
    """The exchange's own ceiling: all-gathers of one slot's bytes, as the cooperative load makes."""
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        part = -(-slot_bytes // world)
        buf = torch.zeros(part * world, dtype=torch.uint8)
        all_gather(buf, buf[rank * part : (rank + 1) * part])
        start, n = time.perf_counter(), 8
        for _ in range(n):
            all_gather(buf, buf[rank * part : (rank + 1) * part])
        if rank == 0:
            Path(out, "gbps").write_text(str(n * slot_bytes / (time.perf_counter() - start) / 1e9))
    finally:
        dist.destroy_process_group()


def exchange_gbps(world: int, slot_bytes: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(exchange_main, args=(world, out, slot_bytes), nprocs=world, start_method="spawn")
        return float(Path(out, "gbps").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--verify", action="store_true", help="each mode also with verify=True")
    args = ap.parse_args()
    files = [str(f.path) for f in streamload.inspect(args.path).files]
    if args.verify and not (Path(args.path) / streamload.pipeline.verify.DIGEST_FILE).exists():
        streamload.pipeline.verify.write_digests(streamload.inspect(args.path))
    total = sum(os.path.getsize(f) for f in files)
    print(f"{total / 1e9:.2f} GB, cold page cache, median of {args.runs} runs\n")
    print("| ranks | mode | bytes read per rank (mean) | all ranks together | slowest rank | vs. alone |")
    print("|---|---|---|---|---|---|")
    ceilings: list[str] = []
    checks = (False, True) if args.verify else (False,)
    for world in args.worlds:
        modes = [(c, v) for c in ((False, True) if world > 1 else (False,)) for v in checks]
        slowest: dict[tuple[bool, bool], list[float]] = {m: [] for m in modes}
        per_rank: dict[tuple[bool, bool], list[float]] = {m: [] for m in modes}
        for _ in range(args.runs):
            for mode in modes:  # alternating: the machine's drift hits every mode alike
                evict(files)
                with tempfile.TemporaryDirectory() as out:
                    mp.start_processes(
                        rank_main, args=(world, args.path, out, mode), nprocs=world, start_method="spawn"
                    )
                    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
                if mode[1]:
                    assert all(r["bytes_verified"] >= r["bytes_read"] for r in results), results
                slowest[mode].append(max(r["seconds"] for r in results))
                per_rank[mode].append(statistics.mean(r["bytes_read"] for r in results))
        alone = statistics.median(slowest[(False, False)])
        if world > 1:
            slot = streamload.base.tuning.tuning(streamload.base.tuning.HOST_STAGING, 0).slot_bytes
            ceilings.append(f"{world} ranks: {exchange_gbps(world, slot):.2f} GB/s of slot bytes")
        for mode in modes:
            s, b = statistics.median(slowest[mode]), statistics.median(per_rank[mode])
            name = ("cooperative" if mode[0] else "alone") + (" + verify" if mode[1] else "")
            cost = f" (verify: {s / statistics.median(slowest[(mode[0], False)]):.2f}x)" if mode[1] else ""
            print(
                f"| {world} | {name} | {b / 1e9:.3f} GB ({b / total:.0%}) | {b * world / total:.2f}x checkpoint "
                f"| {s:.3f} s{cost} | {alone / s:.2f}x |"
            )
    print(f"\nexchange ceiling (gloo all-gather of one slot, warm): {'; '.join(ceilings)}")


if __name__ == "__main__":
    main()
