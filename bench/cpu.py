"""CPU benchmark: streamload vs safetensors.load_file vs runai-model-streamer, warm and cold, in one run.

Every loader runs in a fresh process (no loader warms another's caches), runs alternate, and each
loader makes every tensor resident (reads one byte per 4 KiB page) before its clock stops. Cold runs
evict the files from the page cache with posix_fadvise(DONTNEED) first. The ceiling is parallel
reads of the same files (16 threads x 16 MiB) into reused buffers, with O_DIRECT and buffered, in
the same run; the faster of the two is the ceiling.

    python bench/cpu.py --dir /tmp/sl-bench --runs 5 --markdown docs/cpu-table.md
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PAGE = 4096
LOADERS = ["streamload-mmap", "streamload-posix", "load_file", "runai", "ceiling-odirect", "ceiling-buffered"]


def touch(t) -> None:  # type: ignore[no-untyped-def]
    import torch

    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                 (t.numel() * t.element_size(),), (1,))  # fmt: skip
    if raw.numel():
        raw[::PAGE].sum()


def child(loader: str, files: list[str]) -> dict[str, float]:
    """Load once; return seconds to the first touched tensor and to the last."""
    import torch  # noqa: F401  (imports are not part of the load)

    if loader.startswith("streamload"):
        import streamload
    elif loader == "load_file":
        from safetensors.torch import load_file
    elif loader == "runai":
        from runai_model_streamer import SafetensorsStreamer
    first: float | None = None
    kept = []  # every loader holds the whole model when its clock stops, as a caller would
    start = time.perf_counter()

    def seen(t=None) -> None:  # type: ignore[no-untyped-def]
        nonlocal first
        if t is not None:
            touch(t)
            kept.append(t)
        if first is None:
            first = time.perf_counter() - start

    if loader.startswith("streamload"):
        for _name, t in streamload.iter(files, device="cpu", reader=loader.split("-")[1]):
            seen(t)
    elif loader == "load_file":
        for f in files:
            for t in load_file(f).values():
                seen(t)
    elif loader == "runai":
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for _name, t in streamer.get_tensors():
                seen(t)
    elif loader == "ceiling-odirect":
        parallel_read(files, threads=16, chunk=16 << 20, direct=True)
        seen()
    elif loader == "ceiling-buffered":
        parallel_read(files, threads=16, chunk=16 << 20, direct=False)
        seen()
    else:
        raise SystemExit(f"unknown loader {loader}")
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "first": first or 0.0, "peak_rss": peak_rss()}


def peak_rss() -> int:
    """This process's own peak RSS (VmHWM, not wait4's ru_maxrss, which a child inherits over fork)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return max(int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS"))


def parallel_read(files: list[str], threads: int, chunk: int, direct: bool) -> None:
    """Read the files with `threads` threads of `chunk`-byte preadv into reused, page-aligned buffers."""
    local = threading.local()
    jobs = []
    for f in files:
        size = os.path.getsize(f)
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        jobs += [(fd, off) for off in range(0, size, chunk)]

    def read(job: tuple[int, int]) -> None:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        os.preadv(job[0], [local.buf], job[1])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    for fd in {fd for fd, _ in jobs}:
        os.close(fd)


def evict(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_one(loader: str, files: list[str]) -> dict[str, float]:
    proc = subprocess.Popen([sys.executable, __file__, "--child", loader, *files], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    out = proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"{loader} failed with exit code {proc.returncode}")
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/streamload-bench"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--loaders", nargs="*", default=LOADERS)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1:])))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from streamload.demo import Shape, write_checkpoint

    files = sorted(str(p) for p in args.dir.glob("*.safetensors"))
    if not files:
        args.dir.mkdir(parents=True, exist_ok=True)
        print(f"writing a 2.1 GB bf16 checkpoint to {args.dir} ...", file=sys.stderr)
        write_checkpoint(args.dir, Shape(vocab=32000, hidden=2048, intermediate=5632, layers=18), shards=4)
        files = sorted(str(p) for p in args.dir.glob("*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for mode in ("cold", "warm"):
        for r in range(args.runs):
            for loader in args.loaders:
                if mode == "cold":
                    evict(files)
                elif r == 0:
                    run_one("load_file", files)  # fill the page cache
                res = run_one(loader, files)
                results.setdefault((mode, loader), []).append(res)
                print(f"{mode} run {r} {loader}: {res['seconds']:.3f} s", file=sys.stderr)
    table = render(results, total, args.runs)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)


def render(results: dict[tuple[str, str], list[dict[str, float]]], total: int, runs: int) -> str:
    lines = []
    for mode in ("cold", "warm"):
        med = {ld: statistics.median(r["seconds"] for r in rs) for (m, ld), rs in results.items() if m == mode}
        ceiling = min((v for k, v in med.items() if k.startswith("ceiling")), default=None)
        ref = med.get("load_file")
        lines += [f"\n**{mode}** page cache, {total / 1e9:.2f} GB, median of {runs} runs\n",
                  "| loader | seconds | GB/s | x load_file | of ceiling | first tensor | first tensor share | "
                  "peak RSS |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for (m, loader), rs in results.items():
            if m != mode:
                continue
            s = med[loader]
            first = statistics.median(r["first"] for r in rs)
            rss = max(r["peak_rss"] for r in rs)
            lines.append(
                f"| {loader} | {s:.3f} | {total / s / 1e9:.2f} | {ref / s if ref else 0:.2f}x | "
                f"{ceiling / s if ceiling else 0:.0%} | {first * 1e3:.0f} ms | {first / s:.0%} | "
                f"{rss / 2**30:.2f} GiB |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
