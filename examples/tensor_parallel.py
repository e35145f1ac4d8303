"""Tensor-parallel loading under torchrun: each rank keeps (and reads) only its part of each weight.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py path/to/model [--cooperative]

With `--cooperative`, the ranks also divide the reads of what each needs whole (norms, and row-split
weights whose column blocks are too small to read one by one) and all-gather them. Each rank checks
its tensors against `torch.tensor_split` of the full checkpoint loaded with safetensors, and prints
what it read. Without a GPU per rank it runs on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import streamload

RULES = {
    "*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0,  # column parallel
    "*.gate_proj.weight": 0, "*.up_proj.weight": 0,
    "*.o_proj.weight": 1, "*.down_proj.weight": 1,  # row parallel
    "*embed_tokens.weight": 0, "lm_head.weight": 0,  # vocab parallel
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--cooperative", action="store_true")
    args = ap.parse_args()
    # NCCL needs a GPU of its own per rank on this node.
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    spec = streamload.ShardSpec(RULES)  # rank and world size from torch.distributed
    with streamload.iter(args.path, device=device, shard=spec, cooperative=args.cooperative) as stream:
        state = dict(stream)
    full = {}
    for f in streamload.inspect(args.path).files:
        full |= load_file(f.path)
    for name, t in state.items():
        dim = spec.dim(name, tuple(full[name].shape))
        want = full[name] if dim is None else torch.tensor_split(full[name], world, dim)[rank]
        assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    s = stream.stats
    print(
        f"rank {rank}/{world}: {len(state)} tensors exact, read {s.bytes_read / 1e9:.3f} GB "
        f"of {sum(t.nbytes for t in full.values()) / 1e9:.3f} GB in {s.elapsed:.2f} s via {s.reader}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
