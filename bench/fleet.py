"""A fleet over a simulated network (testbed/netsim.py): N nodes, each wanting the whole checkpoint, load it
from one capped, latent store — independently, and cooperatively (a gloo group over the nodes' own
links: each reads a share, the rest comes from the others). Prints, per N, the slowest node's load, its
first tensor, and the bytes the store served per checkpoint byte. Needs root and nginx.

    python bench/fleet.py DIR --nodes 1 2 4 --storage-mbit 200 --node-mbit 1000 --first-byte-ms 30 --connection-mbps 10

Each node is a fresh process (`python -m testbed.fleet_node`); its clock starts after imports and, for a
cooperative load, after the group formed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

from testbed.fleet_node import start  # noqa: E402
from testbed.netsim import Net  # noqa: E402


def run(
    net: Net, files: list[str], nodes: int, cooperative: bool, lose_after: int | None = None, shard: str | None = None
) -> list[dict]:
    """Every node's result; with `lose_after`, node 1 dies after so many tensors (the survivors' results);
    with `shard`, node i keeps part i of N of each tensor (ShardSpec rules, JSON)."""
    procs = []
    for i in range(nodes):
        extra = ["--rank", str(i), "--world", str(nodes), "--master", f"{net.node_ips[0]}:29517"] if cooperative else []
        if shard is not None:
            extra += ["--shard", shard] + ([] if cooperative else ["--rank", str(i), "--world", str(nodes)])
        if lose_after is not None and i == 1:
            extra += ["--die-after", str(lose_after)]
        procs.append(start(net, i, files, *extra))
    results = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        if lose_after is not None and i == 1:
            continue
        if proc.returncode:
            raise RuntimeError(err[-2000:])
        results.append({**json.loads(out.strip().splitlines()[-1]), "rank": i})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--storage-mbit", type=float, default=200)
    parser.add_argument("--node-mbit", type=float, default=None, help="each node's link, both ways (default: uncapped)")
    parser.add_argument("--first-byte-ms", type=float, default=30)
    parser.add_argument("--connection-mbps", type=float, default=10)
    parser.add_argument("--lose-after", type=int, default=None,
                        help="also: a cooperative load in which node 1 dies after so many tensors")  # fmt: skip
    parser.add_argument("--shard", default=None,
                        help='tensor parallelism: each node keeps its part (ShardSpec rules: {"*": 0})')  # fmt: skip
    parser.add_argument("--straggler-mbit", type=float, default=None,
                        help="node 1's link at this rate (both ways); the others' times are shown apart")  # fmt: skip
    args = parser.parse_args()
    if why := Net.missing():
        sys.exit(f"cannot simulate a network here: {why}")
    names = sorted(p.name for p in args.dir.glob("*.safetensors"))
    nbytes = sum((args.dir / n).stat().st_size for n in names)
    links = f"{args.node_mbit} Mbit/s" if args.node_mbit else "uncapped"
    print(f"store: {args.storage_mbit} Mbit/s, {args.first_byte_ms} ms first byte, {args.connection_mbps} MB/s per "
          f"connection; nodes' links: {links}; checkpoint {nbytes / 1e6:.1f} MB")  # fmt: skip
    if args.shard:
        print(f"tensor parallel: node i of N keeps part i of each tensor, rules {args.shard}")
    if args.straggler_mbit:
        print(f"node 1 is a straggler: its link {args.straggler_mbit} Mbit/s")
    links_of = {i: args.node_mbit for i in range(max(args.nodes))}
    if args.straggler_mbit:
        links_of[1] = args.straggler_mbit
    print(
        "| nodes | how | slowest node (s) | slowest but node 1 (s) | first tensor, slowest (s) | served / checkpoint "
        "| x independent |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.nodes:
        alone = None
        hows = [(False, None), (True, None)] + ([(True, args.lose_after)] if args.lose_after is not None else [])
        for cooperative, lose_after in hows:
            with Net(args.dir, nodes=n, storage_mbit=args.storage_mbit, first_byte_ms=args.first_byte_ms,
                     connection_mbps=args.connection_mbps, node_mbit=links_of) as net:  # fmt: skip
                files = [net.url + name for name in names]
                before = net.served()
                results = run(net, files, n, cooperative and n > 1, lose_after if n > 1 else None, args.shard)
                served = net.served() - before
            slowest = max(r["seconds"] for r in results)
            alone = alone or slowest
            how = "cooperative" if cooperative else "independent"
            how += f", node 1 lost after {lose_after} tensors (survivors)" if lose_after is not None else ""
            others = max((r["seconds"] for k, r in enumerate(results) if r["rank"] != 1), default=slowest)
            print(f"| {n} | {how} | {slowest:.2f} | {others:.2f} | {max(r['first'] for r in results):.2f} | "
                  f"{served / nbytes:.2f} | {slowest / alone:.2f}x |")  # fmt: skip
            if n == 1:
                break


if __name__ == "__main__":
    main()
