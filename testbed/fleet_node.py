"""One node of a simulated fleet (testbed/netsim.py): loads a checkpoint URL, alone or cooperatively with
the other nodes (a gloo group over their own links), and prints one JSON line: each tensor's digest,
when the first tensor and the whole load were done, and the bytes this node read from storage.

    python -m testbed.fleet_node URL [--rank R --world W --master ADDR:PORT] [--die-after N] [--options JSON]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def start(net: Any, node: int, urls: list[str], *extra: str) -> subprocess.Popen[str]:
    """This module run on node `node` of a `testbed.netsim.Net`, its output piped back; gloo on the node's
    own link, not its loopback."""
    env = {**net.env(), "GLOO_SOCKET_IFNAME": "eth0"}
    argv = [sys.executable, "-m", "testbed.fleet_node", *urls, *extra]
    return net.start(node, argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", nargs="+")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--master", default="")
    parser.add_argument("--die-after", type=int, default=None, help="end this process after so many tensors")
    parser.add_argument("--options", default="{}", help="more streamload.iter options, as JSON")
    parser.add_argument("--join", choices=("group", "env"), default="group",
                        help="group: init_process_group first; env: torch's launch variables only")  # fmt: skip
    parser.add_argument("--shard", default=None, help="tensor parallelism: ShardSpec rules {pattern: dim}, as JSON")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import streamload

    options: dict[str, object] = {"device": "cpu", **json.loads(args.options)}
    if args.world > 1 and args.master and args.join == "env":  # as torchrun and PyTorchJob set them
        host, port = args.master.rsplit(":", 1)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, WORLD_SIZE=str(args.world), RANK=str(args.rank))
        options["cooperative"] = True
    elif args.world > 1 and args.master:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        options["cooperative"] = True
    if args.shard is not None:  # this node's part of each tensor (rank and world from the group, or alone)
        options["shard"] = streamload.ShardSpec(json.loads(args.shard), args.rank, args.world)
    start = time.perf_counter()
    first = None
    digests = {}
    with streamload.iter(args.url if len(args.url) > 1 else args.url[0], **options) as stream:
        for name, t in stream:
            first = first if first is not None else time.perf_counter() - start
            digests[name] = hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy()).hexdigest()
            if args.die_after is not None and len(digests) >= args.die_after:
                os._exit(3)  # as a node that dies: no goodbye to the group
    seconds = time.perf_counter() - start
    print(json.dumps({"digests": digests, "first": first, "seconds": seconds, "read": stream.stats.bytes_read}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
