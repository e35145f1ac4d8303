"""A soak run: random loads, early exits, cancellations, concurrent loads and damaged files, for as
long as asked, checking every result and watching for leaks (descriptors, threads, memory, staging).

    python bench/soak.py --minutes 10

Prints what it did and what it found; exits 1 if anything was wrong or leaked.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import torch
from safetensors.torch import load_file, save_file

import streamload

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool, torch.float8_e4m3fn]


def make_checkpoints(root: Path, count: int, rng: random.Random) -> list[Path]:
    paths = []
    for k in range(count):
        g = torch.Generator().manual_seed(k)
        state = {}
        for i in range(rng.randrange(4, 30)):
            dtype = rng.choice(DTYPES)
            shape = tuple(rng.randrange(1, 300) for _ in range(rng.randrange(0, 3)))
            raw = torch.randint(
                0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g
            )
            if dtype == torch.bool:
                raw %= 2
            state[f"model.layers.{i}.w{k}"] = (
                raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
            )
        path = root / f"c{k}.safetensors"
        save_file(state, path)
        paths.append(path)
    return paths


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and torch.equal(bits(a[n]), bits(b[n])) for n in a
    )


def options(rng: random.Random) -> dict[str, object]:
    slots = rng.randrange(1, 5)
    return {
        "device": "cpu",
        "reader": rng.choice(["mmap", "posix"]),
        "ring_bytes": slots * rng.choice([4096, 16384, 65536, 1 << 20]),
        "slots": slots,
        "chunk_bytes": rng.choice([4096, 65536]),
        "order": rng.choice(["layer", "file"]),
    }


class Soak:
    def __init__(self, paths: list[Path], seed: int, scratch: Path) -> None:
        self.paths, self.rng, self.scratch = paths, random.Random(seed), scratch
        self.reference = {p: load_file(p) for p in paths}
        self.done: Counter[str] = Counter()
        self.wrong: list[str] = []

    def check(self, what: str, ok: bool) -> None:
        self.done[what] += 1
        if not ok:
            self.wrong.append(what)

    def full_load(self) -> None:
        path = self.rng.choice(self.paths)
        self.check("full loads, bit-exact", same(streamload.load(path, **options(self.rng)), self.reference[path]))

    def early_exit(self) -> None:
        path, stop = self.rng.choice(self.paths), self.rng.randrange(0, 10)
        with streamload.iter(path, **options(self.rng)) as stream:
            for k, (name, t) in enumerate(stream):
                if not torch.equal(bits(t), bits(self.reference[path][name])):
                    self.wrong.append("early exit: wrong bytes")
                if k >= stop:
                    break
        self.done["breaks out of a sync loop"] += 1

    def cancel(self) -> None:
        path, opts = self.rng.choice(self.paths), options(self.rng)
        delay = self.rng.uniform(0, 0.01)
        backend = self.rng.choice(["asyncio", "trio"])

        async def run() -> None:
            with anyio.move_on_after(delay):
                async with streamload.iter(path, **opts) as stream:
                    async for _ in stream:
                        pass

        started = time.perf_counter()
        anyio.run(run, backend=backend)
        self.check("cancellations (asyncio, trio), each done within 1 s", time.perf_counter() - started < delay + 1.0)

    def concurrent(self) -> None:
        chosen = self.rng.sample(self.paths, 8)
        opts = [options(self.rng) for _ in chosen]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda a: streamload.load(a[0], **a[1]), zip(chosen, opts, strict=True)))
        for path, got in zip(chosen, results, strict=True):
            self.check("loads run 8 at a time", same(got, self.reference[path]))

    def damaged(self) -> None:
        source = self.rng.choice(self.paths)
        data = bytearray(source.read_bytes())
        for _ in range(self.rng.randrange(1, 4)):
            at = self.rng.randrange(len(data))
            if self.rng.random() < 0.3:
                data = data[:at]
            elif data:
                data[at % len(data)] ^= 1 << self.rng.randrange(8)
        bad = self.scratch / "damaged.safetensors"
        bad.write_bytes(bytes(data))
        try:
            want = load_file(bad)
        except Exception:
            want = None
        try:
            got = streamload.load(bad, **options(self.rng))
            ok = want is not None and same(got, want)
        except streamload.StreamloadError as exc:
            ok = want is None and str(bad) in str(exc)
        except Exception:
            ok = False
        self.check("damaged files: same as safetensors, or our error naming the file", ok)


def resources() -> tuple[int, int, int]:
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    threads = sum(not t.name.startswith(("AnyIO worker thread", "Trio thread")) for t in threading.enumerate())
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return fds, threads, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        soak = Soak(make_checkpoints(root, 24, random.Random(args.seed)), args.seed, root)
        actions = [soak.full_load, soak.early_exit, soak.cancel, soak.concurrent, soak.damaged]
        for action in actions:  # warm-up: caches, lazily imported modules, allocator pools
            action()
        start_fds, start_threads, start_rss = resources()
        peak_rss = start_rss
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            soak.rng.choice(actions)()
            if sum(soak.done.values()) % 200 == 0:
                peak_rss = max(peak_rss, resources()[2])
        fds, threads, rss = resources()
    usage = streamload.usage()
    print(f"soak of {args.minutes:g} min, seed {args.seed}: {sum(soak.done.values())} operations\n")
    print("| what | count |\n|---|---|")
    for what, n in sorted(soak.done.items()):
        print(f"| {what} | {n} |")
    print("\n| resource | after warm-up | at the end |\n|---|---|---|")
    print(f"| open file descriptors | {start_fds} | {fds} |")
    print(f"| threads (ours) | {start_threads} | {threads} |")
    mib = 2**20
    print(f"| resident memory | {start_rss / mib:.0f} MiB | {rss / mib:.0f} MiB (peak seen {peak_rss / mib:.0f} MiB) |")
    print(f"| staging held / peak / cap | - | {usage.staging_bytes} / {usage.staging_peak} / {usage.staging_cap} B |")
    leaks = fds > start_fds or threads > start_threads or usage.staging_bytes
    print(f"\nwrong results: {len(soak.wrong)} {sorted(set(soak.wrong))}; leaks: {'yes' if leaks else 'none'}")
    raise SystemExit(1 if soak.wrong or leaks else 0)


if __name__ == "__main__":
    main()
