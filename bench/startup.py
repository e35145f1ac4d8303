"""Where a load's fixed cost goes: each start-up step timed on its own, in fresh processes.

    python bench/startup.py /tmp/streamload-bench --device cpu --runs 7

Each run is a new process with torch imported (and CUDA initialised) before the clock, as in a
user's program, and a warm page cache. Steps, in the order a load takes them: `import streamload`;
`iter()` (headers, tuning, routing, plan); the pipeline's start (files opened, reader threads
joined, staging taken, slots made); the first batch (its reads and its tensors); then the rest of the
load. The same process then loads again (a second stream: threads, slots and pinned memory reused).
Printed: the median of each step, and `safetensors.torch.load_file` of the same files, touched alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PAGE = 4096


def _touch(t: object) -> None:
    """streamload.commands.bench's page touch, repeated: importing it would import streamload before the clock."""
    import torch

    assert isinstance(t, torch.Tensor)
    if t.is_cuda or t.numel() == 0:
        return
    raw = torch.empty(0, dtype=torch.uint8).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (t.numel() * t.element_size(),), (1,)
    )
    raw[::PAGE].sum()


def child(path: str, device: str, loader: str) -> dict[str, float]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)
    steps: dict[str, float] = {}
    t0 = last = time.perf_counter()

    def mark(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        steps[step] = now - last
        last = now

    if loader == "load_file":
        import glob

        from safetensors.torch import load_file

        mark("import")
        for f in sorted(glob.glob(f"{path}/*.safetensors")):
            for t in load_file(f, device=device).values():
                _touch(t)
        mark("load")
    else:
        import streamload

        mark("import")
        stream = streamload.iter(path, device=device)
        mark("iter() (headers, tuning, routing, plan)")
        pipeline = stream._pipeline
        with pipeline._busy:
            pipeline._start()
        mark("pipeline start (files, threads, staging, slots)")
        first = "first tensor (first batch read and made)"
        with stream:
            for _, t in stream:
                _touch(t)
                if first not in steps:
                    mark(first)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        mark("the rest of the load")
        steps["total"] = time.perf_counter() - t0
        again = time.perf_counter()
        with streamload.iter(path, device=device) as stream:
            first = None
            for _, t in stream:
                _touch(t)
                first = first or time.perf_counter() - again
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        steps["second stream: first tensor"] = first or 0.0
        steps["second stream: total"] = time.perf_counter() - again
        return steps
    steps["total"] = time.perf_counter() - t0
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.path, args.device, args.child)))
        return
    from streamload.commands.bench import compile_streamload, parallel_read
    from streamload.plan.checkpoint import open_checkpoint

    compile_streamload()

    files = [str(f.path) for f in open_checkpoint(args.path).files]
    results: dict[str, list[dict[str, float]]] = {"streamload": [], "load_file": []}
    for _ in range(args.runs):
        for loader in results:
            parallel_read(files, direct=False, pinned=False)()  # warm
            cmd = [sys.executable, __file__, args.path, "--device", args.device, "--child", loader]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[loader].append(json.loads(out.stdout))
    for loader, runs in results.items():
        print(f"\n{loader} ({args.device}, warm, median of {len(runs)} fresh processes)")
        for step in runs[0]:
            print(f"  {step:<48} {1e3 * statistics.median(r[step] for r in runs):8.1f} ms")
    gap = statistics.median(r["total"] for r in results["streamload"]) - statistics.median(
        r["total"] for r in results["load_file"]
    )
    print(f"\nstreamload - load_file, whole load with imports: {1e3 * gap:+.1f} ms")


if __name__ == "__main__":
    main()
