"""One node loading over a simulated network (testbed/netsim.py): a storage host serving DIR over HTTP,
or as an S3 bucket (`--s3`), with a first-byte latency, a rate cap per connection and on its link.
Prints, for each loader and set of options, the median load time, its first tensor, its rate against
the link's (what parallel `curl`s reach on the same link) and the bytes the store served per checkpoint
byte. Runs take turns (streamload's options, then runai's S3 reader with `--runai`), each a fresh
process. Needs root and nginx (see testbed/netsim.py).

    python bench/net.py DIR --storage-mbit 200 --first-byte-ms 30 --connection-mbps 10 \\
        --options '{}' '{"chunk_bytes": 1048576, "slots": 32, "threads": 16}'
    python bench/net.py DIR --s3 --connection-mbps 1 --runai --runs 3

Torch and the loader are imported before the clock starts (a server has them loaded already).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

from testbed.netsim import BUCKET, Net  # noqa: E402

NODE = r"""
import json, sys, time
import torch
files, loader, options = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
if loader == "runai":
    from runai_model_streamer import SafetensorsStreamer
    def tensors():
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            yield from streamer.get_tensors()
else:
    import streamload, streamload.api
    def tensors():
        with streamload.iter(files, device="cpu", **options) as stream:
            yield from stream
start, first, n = time.perf_counter(), None, 0
for name, t in tensors():
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
    parser.add_argument("--s3", action="store_true", help="serve the directory as an S3 bucket (s3://models/)")
    parser.add_argument("--runai", action="store_true", help="also runai-model-streamer's reader (S3 only)")
    parser.add_argument("--options", nargs="+", default=["{}"], help="streamload.iter options, as JSON")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    if why := Net.missing():
        sys.exit(f"cannot simulate a network here: {why}")
    if args.runai and not args.s3:
        sys.exit("runai-model-streamer reads S3 (not HTTP): add --s3")
    names = sorted(p.name for p in args.dir.glob("*.safetensors"))
    with Net(args.dir, nodes=1, storage_mbit=args.storage_mbit, first_byte_ms=args.first_byte_ms,
             connection_mbps=args.connection_mbps, s3=args.s3) as net:  # fmt: skip
        files = [net.url + name for name in names]
        plain = [f"http://{net.storage_ip}/{BUCKET}/{name}" for name in names] if args.s3 else files
        nbytes = sum((args.dir / name).stat().st_size for name in names)
        # The link's rate: every file at once, in twice as many connections as the link has room for
        parts = max(4, math.ceil(2 * args.storage_mbit / 8 / args.connection_mbps / len(names)))
        start = time.perf_counter()
        fetches = " & ".join(
            f"curl -s -o /dev/null -r {part} {url}" for url, name in zip(plain, names, strict=True)
            for part in _parts((args.dir / name).stat().st_size, parts)
        )  # fmt: skip
        net.run_on("n0", ["bash", "-c", f"{fetches} & wait"], timeout=600)
        link = nbytes / (time.perf_counter() - start)
        print(f"store: {'S3' if args.s3 else 'HTTP'}, first byte {args.first_byte_ms} ms, {args.connection_mbps} MB/s "
              f"per connection, link {args.storage_mbit} Mbit/s (parallel curl: {link / 1e6:.1f} MB/s); "
              f"{nbytes / 1e6:.1f} MB, median of {args.runs}")  # fmt: skip
        cases = [("streamload", options) for options in args.options] + ([("runai", "{}")] if args.runai else [])
        runs: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in cases}
        for _ in range(args.runs):
            for loader, options in cases:
                before = net.served()
                done = net.run_on("n0", [sys.executable, "-c", NODE, json.dumps(files), loader, options],
                                  timeout=600, cwd=ROOT, env=net.env())  # fmt: skip
                if done.returncode:
                    print(f"{loader} {options} failed: {done.stderr.strip().splitlines()[-1]}")
                    continue
                run = json.loads(done.stdout)
                run["served"] = (net.served() - before) / nbytes
                runs[(loader, options)].append(run)
        print("| loader | options | load (s) | first tensor (s) | MB/s | of link | served / checkpoint | x first |")
        print("|---|---|---|---|---|---|---|---|")
        base = None
        for (loader, options), done_runs in runs.items():
            if not done_runs:
                continue
            seconds = statistics.median(r["seconds"] for r in done_runs)
            base = base or seconds
            first = statistics.median(r["first"] for r in done_runs)
            rate = done_runs[0]["bytes"] / seconds
            served = statistics.median(r["served"] for r in done_runs)
            print(f"| {loader} | `{options}` | {seconds:.2f} | {first:.2f} | {rate / 1e6:.1f} | {rate / link:.0%} | "
                  f"{served:.3f} | {seconds / base:.2f}x |")  # fmt: skip


def _parts(size: int, n: int) -> list[str]:
    """`n` byte ranges (curl's -r) covering a file of `size` bytes."""
    cuts = [size * k // n for k in range(n + 1)]
    return [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(cuts) if hi > lo]


if __name__ == "__main__":
    main()
