"""One node loading over a simulated network (tests/netsim.py): a storage host serving DIR over HTTP
with a first-byte latency, a rate cap per connection and on its link. Prints, for each set of options,
the load's time, its first tensor, its rate against the link's (what parallel `curl`s reach on the same
link) and the bytes the store served per checkpoint byte. Needs root and nginx (see tests/netsim.py).

    python bench/net.py DIR --storage-mbit 200 --first-byte-ms 30 --connection-mbps 10 \\
        --options '{}' '{"chunk_bytes": 1048576, "slots": 32, "threads": 16}'

Torch and streamload are imported before the clock starts (a server has them loaded already).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

from tests.netsim import Net  # noqa: E402

NODE = r"""
import json, sys, time
import torch, streamload, streamload.api
files, options = json.loads(sys.argv[1]), json.loads(sys.argv[2])
start, first, n = time.perf_counter(), None, 0
with streamload.iter(files, device="cpu", **options) as stream:
    for name, t in stream:
        first = first if first is not None else time.perf_counter() - start
        n += t.numel() * t.element_size()
print(json.dumps({"seconds": time.perf_counter() - start, "first": first, "bytes": n}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a directory of *.safetensors files")
    parser.add_argument("--storage-mbit", type=float, default=200)
    parser.add_argument("--first-byte-ms", type=float, default=30)
    parser.add_argument("--connection-mbps", type=float, default=10, help="MB/s per connection")
    parser.add_argument("--options", nargs="+", default=["{}"], help="streamload.iter options, as JSON")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    if why := Net.missing():
        sys.exit(f"cannot simulate a network here: {why}")
    names = sorted(p.name for p in args.dir.glob("*.safetensors"))
    with Net(args.dir, nodes=1, storage_mbit=args.storage_mbit, first_byte_ms=args.first_byte_ms,
             connection_mbps=args.connection_mbps) as net:  # fmt: skip
        files = [net.url + name for name in names]
        nbytes = sum((args.dir / name).stat().st_size for name in names)
        start = time.perf_counter()  # the link's rate: every file at once, 4 connections each
        fetches = " & ".join(
            f"curl -s -o /dev/null -r {part} {url}" for url, name in zip(files, names, strict=True)
            for part in _quarters((args.dir / name).stat().st_size)
        )  # fmt: skip
        net.run_on("n0", ["bash", "-c", f"{fetches} & wait"], timeout=600)
        link = nbytes / (time.perf_counter() - start)
        print(f"store: first byte {args.first_byte_ms} ms, {args.connection_mbps} MB/s per connection, link "
              f"{args.storage_mbit} Mbit/s (parallel curl: {link / 1e6:.1f} MB/s); {nbytes / 1e6:.1f} MB")  # fmt: skip
        print("| options | load (s) | first tensor (s) | MB/s | of link | served / checkpoint |")
        print("|---|---|---|---|---|---|")
        for options in args.options:
            for _ in range(args.runs):
                before = net.served()
                done = net.run_on("n0", [sys.executable, "-c", NODE, json.dumps(files), options], timeout=600,
                                  cwd=ROOT)  # fmt: skip
                if done.returncode:
                    print(f"| `{options}` | failed: {done.stderr.strip().splitlines()[-1]} |")
                    continue
                run = json.loads(done.stdout)
                rate = run["bytes"] / run["seconds"]
                print(f"| `{options}` | {run['seconds']:.2f} | {run['first']:.2f} | {rate / 1e6:.1f} | "
                      f"{rate / link:.0%} | {(net.served() - before) / nbytes:.3f} |")  # fmt: skip


def _quarters(size: int) -> list[str]:
    """Four byte ranges (curl's -r) covering a file of `size` bytes."""
    cuts = [size * k // 4 for k in range(5)]
    return [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(cuts) if hi > lo]


if __name__ == "__main__":
    main()
