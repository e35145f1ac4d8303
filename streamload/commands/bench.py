"""`streamload bench`: every loader on one checkpoint, each run in a fresh process, side by side.

Runs alternate between loaders (so drift on a noisy machine hits all of them alike) and the median
of N is reported. The clock starts before the loader's own import (torch, and CUDA, are initialised
before it, as in a user's program) and stops once every tensor is resident on the target device: on
the CPU one byte of every 4 KiB page is read, so a lazily mapped tensor counts as loaded only once
its pages are in. Cold runs evict the files from the page cache first. The ceilings are measured in
the same run, timing the transfer alone (their buffers are allocated before the clock starts):
parallel reads of the same files, and pinned host-to-device copies.

    streamload bench path/to/model --device cpu --cold --runs 5 --json out.json --plot out.png
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import queue
import re
import statistics
import subprocess  # nosec B404 # children are this package's own modules, argv lists, no shell
import sys
import time
import timeit
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PAGE = 4096
READ_THREADS, READ_CHUNK = 16, 16 << 20  # the read ceiling: 16 threads x 16 MiB requests


@dataclass(frozen=True)
class Loader:
    name: str
    needs: str | None  # module that must be importable, else the loader is skipped with a note
    devices: tuple[str, ...]  # device types it runs on
    install: str = "pip install -e '.[bench]'"  # what brings `needs`
    schemes: tuple[str, ...] = ("file",)  # where the checkpoint may be: local files, or URL schemes


LOADERS = [
    Loader("streamload-mmap", None, ("cpu",)),
    Loader("streamload-posix", None, ("cpu", "cuda")),
    Loader("streamload-direct", None, ("cpu", "cuda")),
    Loader("streamload-mmap+verify", None, ("cpu",)),  # verify=True: the digests known for the files
    Loader("streamload-posix+verify", None, ("cpu", "cuda")),
    Loader("streamload-kvikio", "kvikio", ("cuda",), "pip install -e '.[cu12]' or -e '.[cu13]'"),
    Loader("safetensors-load_file", "safetensors", ("cpu", "cuda")),
    Loader("safetensors-safe_open", "safetensors", ("cpu", "cuda")),
    Loader("fastsafetensors", "fastsafetensors", ("cpu", "cuda")),
    Loader("fastsafetensors-gds", "fastsafetensors", ("cuda",)),
    Loader("runai", "runai_model_streamer", ("cpu", "cuda")),
    Loader("instanttensor", "instanttensor", ("cuda",), "pip install instanttensor"),
    Loader("streamload-range", "obstore", ("cpu", "cuda"), "pip install -e '.[remote]'", ("s3", "http", "https")),
    Loader("runai-s3", "runai_model_streamer_s3", ("cpu", "cuda"), "pip install runai-model-streamer-s3", ("s3",)),
    Loader("ceiling-read", None, ("cpu", "cuda")),
    Loader("ceiling-odirect", None, ("cpu", "cuda")),
    Loader("ceiling-h2d", None, ("cuda",)),
]


@dataclass
class Run:
    """One load in one process: total seconds, and when each tensor became usable."""

    seconds: float
    arrivals: list[tuple[float, int]]  # (seconds since start, bytes usable so far)
    first_tensor: float
    first_layer: float | None
    peak_rss: int
    peak_extra_device: int | None = None


@dataclass
class Summary:
    loader: str
    mode: str
    runs: list[Run] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # one line per failed run

    def median(self, key: Callable[[Run], float | None]) -> float | None:
        values = [v for r in self.runs if (v := key(r)) is not None]
        return statistics.median(values) if values else None


# -- one load, in the child process -----------------------------------------------------------------


def touch(t: Any) -> None:
    """Make a tensor resident: on the CPU read one byte per page; on a GPU its bytes are there."""
    import torch

    if not t.is_cpu or t.numel() == 0:
        return
    raw = torch.empty(0, dtype=torch.uint8).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (t.numel() * t.element_size(),), (1,)
    )
    raw[::PAGE].sum()


def _tensors(loader: str, files: list[str], device: str, options: dict[str, int]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs as each loader gives them, on `device` (`options`: streamload's tuning)."""
    if loader.startswith("streamload-"):
        import streamload

        reader, _, verify = loader.removeprefix("streamload-").partition("+")
        yield from streamload.iter(files, device=device, reader=reader, verify=verify == "verify", **options)  # type: ignore[arg-type]
    elif loader == "safetensors-load_file":
        from safetensors.torch import load_file

        for f in files:
            yield from load_file(f, device=device).items()
    elif loader == "safetensors-safe_open":
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt", device=device) as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
    elif loader.startswith("fastsafetensors"):
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        with closing(SafeTensorsFileLoader(SingleGroup(), device, nogds=loader == "fastsafetensors")) as fl:
            fl.add_filenames({0: files})
            with closing(fl.copy_files_to_device()) as buffer:
                for name in buffer.key_to_rank_lidx:
                    yield name, buffer.get_tensor(name)  # views of its buffer, valid until close()
    elif loader in ("runai", "runai-s3"):
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for name, t in streamer.get_tensors():
                yield name, t.to(device)  # the tensor itself where it is on `device` already
    elif loader == "instanttensor":
        from instanttensor import safe_open as it_open

        with it_open(files, framework="pt", device=device) as fh:
            yield from fh.tensors()
    else:
        raise SystemExit(f"unknown loader {loader}")


def parallel_read(files: list[str], direct: bool, pinned: bool) -> Callable[[], None]:
    """A function that reads the files with READ_THREADS threads of READ_CHUNK-byte preadv into
    per-thread buffers (allocated now, not when it runs)."""
    if pinned:
        import torch

        from streamload.read.base import writable_bytes

        tensors = [torch.empty(READ_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(READ_THREADS)]
        buffers = [writable_bytes(t) for t in tensors]
    else:
        buffers = [memoryview(mmap.mmap(-1, READ_CHUNK)) for _ in range(READ_THREADS)]  # page-aligned for O_DIRECT
    free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for b in buffers:
        b[:: mmap.PAGESIZE] = bytes(len(b[:: mmap.PAGESIZE]))  # fault the pages in before the clock
        free.put(b)

    def one(fd: int, offset: int) -> None:
        buf = free.get()
        try:
            os.preadv(fd, [buf], offset)
        finally:
            free.put(buf)

    def run() -> None:
        fds = [os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for f in files]
        try:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                sizes = [os.path.getsize(f) for f in files]
                jobs = [(fd, off) for fd, size in zip(fds, sizes, strict=True) for off in range(0, size, READ_CHUNK)]
                list(pool.map(lambda job: one(*job), jobs))
        finally:
            for fd in fds:
                os.close(fd)

    return run


def _h2d(nbytes: int, device: str) -> Callable[[], None]:
    """A function that copies `nbytes` from pinned host memory to the device, 256 MiB at a time."""
    import torch

    chunk = 256 << 20
    module = torch.get_device_module(device)  # torch's own for the device's type (torch.cuda)
    host = torch.ones(chunk, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    dev.copy_(host[: 1 << 20])  # the first copy sets up the CUDA context's copy engine
    module.synchronize(device)

    def run() -> None:
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            dev[:n].copy_(host[:n], non_blocking=True)
        module.synchronize(device)

    return run


def child(
    loader: str, files: list[str], device: str, options: dict[str, int] | None = None, keep: bool = True,
    host: bool = True,
) -> Run:  # fmt: skip
    """One timed load. `keep`: hold every tensor to the end (as `load_file`'s dict does); else drop each
    once touched, as a server that copies each weight into its own buffers does. `host`: `device` is
    host memory (its kind's `host_memory`, asked by the parent: the child imports nothing of
    streamload's before the clock); else the device's memory is measured, and its work waited for,
    with torch's module for its type (torch.cuda)."""
    memory: Any = None
    base = 0
    if not host:
        import torch

        memory = torch.get_device_module(device)
        memory.init()
        base = memory.memory_allocated(device)
        memory.reset_peak_memory_stats(device)
    if loader.startswith("ceiling"):  # no torch on a CPU (its import is ~3 s of CPU here, outside the clock)
        total = sum(os.path.getsize(f) for f in files)
        # the transfer made ready before the clock: its buffers (pinned ones cost ~0.6 s per GiB)
        if loader == "ceiling-h2d":
            transfer = _h2d(total, device)
        else:
            transfer = parallel_read(files, direct=loader == "ceiling-odirect", pinned=not host)
        start = time.perf_counter()
        transfer()
        seconds = time.perf_counter() - start
        return Run(seconds, [(seconds, total)], seconds, None, _peak_rss())
    layer0 = _layer0_names(files)
    import torch  # before the clock: every loader's user has it imported

    start = time.perf_counter()  # _tensors imports the loader: a user's program pays for its import too
    kept, arrivals, done, first_layer = [], [], 0, None
    pending = set(layer0)
    for name, t in _tensors(loader, files, device, options or {}):
        touch(t)
        done += t.numel() * t.element_size()
        if keep:
            kept.append(t)
        del t
        now = time.perf_counter() - start
        arrivals.append((now, done))
        pending.discard(name)
        if first_layer is None and layer0 and not pending:
            first_layer = now
    if memory is not None:
        memory.synchronize(device)
    seconds = time.perf_counter() - start
    extra = None if memory is None else max(0, memory.max_memory_allocated(device) - base - done)
    first = arrivals[0][0] if arrivals else seconds
    return Run(seconds, arrivals, first, first_layer, _peak_rss(), extra)


def _layer0_names(files: list[str]) -> set[str]:
    """Layer 0's tensor names, read from the headers without importing streamload (which is measured)."""
    names: set[str] = set()
    for f in files:
        if "://" in f:
            return set()  # objects: no first-layer time (their headers would cost requests inside the clock)
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            names |= set(json.loads(fh.read(n))) - {"__metadata__"}
    return {n for n in names if re.match(r"^(?:.*?\.)?(?:layers|layer|h|blocks|block)\.0(?:\.|$)", n)}  # layer_keys.py


def _peak_rss() -> int:
    """This process's own peak RSS (VmHWM; wait4's ru_maxrss would include what fork inherited)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return max(int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS"))


# -- the parent: schedule, evict, summarise -----------------------------------------------------------


def evict(files: Iterable[str]) -> None:
    """Drop the files from the page cache (flushing them first), so the next read comes from the disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def available(loaders: Iterable[str], device: str, scheme: str = "file") -> tuple[list[str], list[str]]:
    """The loaders that can run here, and a note for each that cannot (loaders for another storage are
    left out silently when `loaders` is everything)."""
    by_name = {ld.name: ld for ld in LOADERS}
    kind = device.split(":")[0]
    ok, notes = [], []
    for name in loaders:
        ld = by_name.get(name)
        if ld is None:
            raise ValueError(f"unknown loader {name!r}; known: {', '.join(by_name)}")
        if scheme not in ld.schemes:
            notes.append(f"{name}: skipped, does not read {scheme}:// checkpoints")
        elif kind not in ld.devices:
            notes.append(f"{name}: skipped, does not run on {kind}")
        elif ld.needs and importlib.util.find_spec(ld.needs) is None:
            notes.append(f"{name}: skipped, {ld.needs} is not installed ({ld.install})")
        else:
            ok.append(name)
    return ok, notes


def _prepare(path: str | os.PathLike[str], device: str) -> tuple[list[str], str]:
    """The checkpoint's files, and `device` with an index where its kind has devices of their own ("cuda"
    -> "cuda:0": the peers need one, and device 0 is the one a fresh child process means); streamload's
    bytecode written first (`compile_streamload`)."""
    import torch

    from streamload.device import kind_of
    from streamload.plan.checkpoint import open_checkpoint

    compile_streamload()
    dev = torch.device(device)
    files = [str(f.path) for f in open_checkpoint(path).files]
    return files, f"{dev.type}:0" if dev.index is None and not kind_of(dev).host_memory else device


def run_child(
    loader: str, files: list[str], device: str, options: dict[str, int] | None = None, keep: bool = True
) -> Run:
    """`child` in a fresh interpreter that imports this very streamload: it starts in the folder that
    holds the package, since `-m` puts the working directory first on the path (a clone's `streamload/`
    folder there would shadow the installed package)."""
    from streamload.device import kind_of

    files = [f if "://" in f else os.path.abspath(f) for f in files]
    memory = "host" if kind_of(device).host_memory else "device"
    cmd = [sys.executable, "-m", "streamload.commands.bench", "--child", loader, device, memory,
           json.dumps(options or {}), "keep" if keep else "drop", *files]  # fmt: skip
    home = Path(__file__).resolve().parent.parent
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=home)  # nosec B603 # argv built here
    if out.returncode:
        raise RuntimeError(f"{loader} failed: {failure_line(out.stderr)}")
    return Run(**json.loads(out.stdout))


def failure_line(stderr: str, most: int = 200) -> str:
    """One readable line from a failed child's stderr: the exception line, not a dump."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    # The traceback's last "Name: message" line; a loader may print more after it, or no traceback.
    found = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    line = (found or lines or ["(no output)"])[-1]
    line = " ".join(line.split())
    return line if len(line) <= most else line[: most - 3] + "..."


def compile_streamload() -> None:
    """Write streamload's bytecode before any timed run, as an installed package has it: a checkout run
    with PYTHONDONTWRITEBYTECODE set would otherwise compile its modules again in every fresh process
    (~30 ms for a load's imports, more with an integration) while the peers' come compiled."""
    import compileall

    compileall.compile_dir(os.path.dirname(os.path.abspath(__file__)), quiet=2)  # a no-op when up to date


def bench(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    modes: tuple[str, ...] = ("warm",),
    runs: int = 5,
    loaders: Iterable[str] | None = None,
    log: Callable[[str], None] = print,
    keep: bool = True,
) -> list[Summary]:
    """Run every available loader `runs` times per mode, alternating; returns the raw runs.
    `keep=False`: each tensor is dropped once touched (see `child`)."""
    files, device = _prepare(path, device)
    scheme = files[0].split("://", 1)[0] if "://" in files[0] else "file"
    everything = loaders is None
    default = [ld.name for ld in LOADERS if scheme in ld.schemes and "+verify" not in ld.name]
    names, notes = available(loaders or default, device, scheme)
    for note in notes if not everything else [n for n in notes if "does not read" not in n]:
        log(note)
    if scheme != "file":
        modes = ("remote",)  # no page cache to empty or fill: every run reads from the server
    results = {(mode, name): Summary(name, mode) for mode in modes for name in names}
    warm = parallel_read(files, direct=False, pinned=False) if "warm" in modes else None  # buffers made once
    for mode in modes:
        for r in range(runs):
            for name in names:
                if mode == "cold":
                    evict(files)
                elif warm is not None:  # (re)fill the page cache: a loader may have evicted what it read
                    warm()
                try:
                    run = run_child(name, files, device, keep=keep)
                except RuntimeError as exc:
                    log(f"{mode} run {r + 1}/{runs} {exc}")
                    results[(mode, name)].failures.append(str(exc))
                    continue
                results[(mode, name)].runs.append(run)
                log(f"{mode} run {r + 1}/{runs} {name}: {run.seconds:.3f} s")
    return list(results.values())


@dataclass
class Setting:
    """One point of a sweep: streamload's tuning and its median time."""

    options: dict[str, int]
    seconds: float
    spread: tuple[float, float] = (0.0, 0.0)  # the fastest and slowest of its runs

    def describe(self) -> str:
        o = self.options
        return (f"threads={o['threads']} chunk={_size(o['chunk_bytes'])} "
                f"ring={_size(o['ring_bytes'])}/{o['slots']} slots")  # fmt: skip


def sweep(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    cold: bool = False,
    runs: int = 1,
    log: Callable[[str], None] = print,
) -> list[Setting]:
    """Time streamload (reader "auto") on a grid around its defaults: threads x request size x ring.

    Each run is a fresh process; every setting runs once per round, `runs` rounds, and its median is
    reported. The first setting is the defaults."""
    from streamload.base import tuning
    from streamload.device import kind_of

    files, device = _prepare(path, device)
    base = tuning.tuning(kind_of(device).staging, sum(os.path.getsize(f) for f in files))
    threads = sorted({max(1, base.threads // 2), base.threads, base.threads * 2})
    chunks = sorted({max(1 << 16, base.chunk_bytes // 4), base.chunk_bytes, base.chunk_bytes * 4})
    rings = [(base.ring_bytes // 4, max(1, base.slots // 2)), (base.ring_bytes, base.slots),
             (base.ring_bytes * 4, base.slots * 2)]  # fmt: skip
    grid = [base] + [tuning.Tuning(r, n, t, c) for t in threads for c in chunks for r, n in rings]
    grid = list(dict.fromkeys(grid))  # the defaults first, each setting once
    seconds: list[list[float]] = [[] for _ in grid]
    settings: list[Setting] = []
    warm = parallel_read(files, direct=False, pinned=False)  # its buffers made once, not per run (~0.1 s)
    for r in range(runs):  # round-robin, as `bench` alternates loaders: drift hits every setting alike
        for k, t in enumerate(grid):
            evict(files) if cold else warm()
            seconds[k].append(run_child("streamload-auto", files, device, t._asdict()).seconds)
            if r == runs - 1:
                spread = (min(seconds[k]), max(seconds[k]))
                settings.append(Setting(t._asdict(), statistics.median(seconds[k]), spread))
                log(f"{settings[-1].describe()}{' (defaults)' if k == 0 else ''}: {settings[-1].seconds:.3f} s")
    return settings


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n % (1 << 30) == 0 else f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n >> 10} KiB"


def report(summaries: list[Summary], total: int) -> list[dict[str, Any]]:
    """One row per loader and mode, with the ceiling fractions and ratios to load_file."""
    rows = []
    summaries = [s for s in summaries if s.runs]
    for mode in sorted({s.mode for s in summaries}):
        group = [s for s in summaries if s.mode == mode]
        secs = {s.loader: s.median(lambda r: r.seconds) or 0.0 for s in group}
        ceiling = _ceiling_seconds(secs, mode)
        ref = secs.get(REFERENCE.get(mode, "safetensors-load_file"))
        for s in group:
            t = secs[s.loader]
            extra = [r.peak_extra_device for r in s.runs if r.peak_extra_device is not None]
            rows.append({
                "mode": mode,
                "loader": s.loader,
                "runs": len(s.runs),
                "seconds": t,
                "gb_per_s": total / t / 1e9 if t else 0.0,
                "x_load_file": ref / t if ref and t else None,
                "of_ceiling": ceiling / t if ceiling and t else None,
                "first_tensor_s": s.median(lambda r: r.first_tensor),
                "first_layer_s": s.median(lambda r: r.first_layer),
                "peak_rss": max(r.peak_rss for r in s.runs),
                "peak_extra_device": max(extra) if extra else None,
            })  # fmt: skip
    return rows


REFERENCE = {"remote": "runai-s3"}  # the "x reference" column: load_file for files, runai for S3


def _ceiling_seconds(secs: dict[str, float], mode: str) -> float | None:
    """The bound of a mode: storage gives the faster of its two read ceilings, and on a GPU the slower of
    storage and PCIe bounds. Warm on the CPU nothing does: a loader that maps the page cache copies
    nothing, so the read ceiling (a copy) is no bound there."""
    if mode == "warm" and "ceiling-h2d" not in secs:
        return None
    reads = [secs[n] for n in ("ceiling-read", "ceiling-odirect") if n in secs]
    bounds = ([min(reads)] if reads else []) + ([secs["ceiling-h2d"]] if "ceiling-h2d" in secs else [])
    return max(bounds) if bounds else None


def table(rows: list[dict[str, Any]], total: int) -> str:
    """Markdown, one table per mode ("of ceiling": see `_ceiling_seconds`)."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    out = []
    for mode in sorted({r["mode"] for r in rows}):
        ref = REFERENCE.get(mode, "load_file")
        out += [f"\n**{mode}**, {total / 1e9:.2f} GB, median of {max(r['runs'] for r in rows)} runs\n",
                f"| loader | seconds | GB/s | x {ref} | of ceiling | first tensor | first layer | peak RSS "
                "| peak extra device |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in (r for r in rows if r["mode"] == mode):
            dev = "-" if r["peak_extra_device"] is None else f"{r['peak_extra_device'] / 2**20:.0f} MiB"
            out.append(
                f"| {r['loader']} | {r['seconds']:.3f} | {r['gb_per_s']:.2f} | "
                f"{'-' if r['x_load_file'] is None else format(r['x_load_file'], '.2f') + 'x'} | "
                f"{'-' if r['of_ceiling'] is None else format(r['of_ceiling'], '.0%')} | "
                f"{ms(r['first_tensor_s'])} | {ms(r['first_layer_s'])} | {r['peak_rss'] / 2**30:.2f} GiB | {dev} |"
            )
    return "\n".join(out) + "\n"


def plot(summaries: list[Summary], rows: list[dict[str, Any]], total: int, path: str | os.PathLike[str]) -> None:
    """Arrival curves (fraction of bytes usable over time, median-time run of each loader) and GB/s bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [s for s in summaries if s.runs]
    modes = sorted({s.mode for s in summaries})
    fig, axes = plt.subplots(len(modes), 2, figsize=(13, 4.2 * len(modes)), squeeze=False)
    for row_axes, mode in zip(axes, modes, strict=True):
        curves, bars = row_axes
        for s in (s for s in summaries if s.mode == mode and not s.loader.startswith("ceiling")):
            run = sorted(s.runs, key=lambda r: r.seconds)[len(s.runs) // 2]
            xs = [0.0] + [t for t, _ in run.arrivals] + [run.seconds]
            ys = [0.0] + [b / total for _, b in run.arrivals] + [run.arrivals[-1][1] / total if run.arrivals else 0]
            curves.step(xs, ys, where="post", label=s.loader, linewidth=1.8)
        curves.set(title=f"{mode}: bytes usable by the caller", xlabel="seconds since start",
                   ylabel="fraction of checkpoint", ylim=(0, 1.02))  # fmt: skip
        curves.grid(alpha=0.3)
        curves.legend(fontsize=8)
        mine = [r for r in rows if r["mode"] == mode]
        loaders = [r for r in mine if not r["loader"].startswith("ceiling")]
        bars.barh([r["loader"] for r in loaders], [r["gb_per_s"] for r in loaders], color="tab:blue")
        for r in (r for r in mine if r["loader"].startswith("ceiling")):
            bars.axvline(r["gb_per_s"], linestyle="--", color="tab:red" if "read" in r["loader"] else "tab:gray")
            bars.text(r["gb_per_s"], 0.02, r["loader"], transform=bars.get_xaxis_transform(), rotation=90,
                      fontsize=7, va="bottom", ha="right")  # fmt: skip
        ceilings = any(r["loader"].startswith("ceiling") for r in mine)
        bars.set(title=f"{mode}: GB/s" + (" (dashed: ceilings)" if ceilings else ""), xlabel="GB/s")
        bars.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hash_rates(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of one core for each digest verify= checks, on `nbytes` already in memory."""
    import hashlib

    from streamload.pipeline.verify import block_digest

    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    rates = {}
    md5 = lambda d: hashlib.md5(d, usedforsecurity=False).digest()  # noqa: E731 # as S3's ETags: a checksum
    blocks = lambda name: lambda d: [block_digest(d[a : a + (1 << 20)], name) for a in range(0, len(d), 1 << 20)]  # noqa: E731
    for name, digest in (("sha256", lambda d: hashlib.sha256(d).digest()), ("md5", md5),
                         ("blake3 (format-2 blocks: peers, cache copies, verify=)", blocks("blake3")),
                         ("xxh3-64 (format-1 blocks: verify= only)", blocks("xxh3-64"))):  # fmt: skip
        rates[name] = nbytes / min(timeit.repeat(lambda d=digest: d(data), number=1, repeat=3)) / 1e9
    return rates


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:  # run_child's process: its one Run, as JSON
    loader, device, memory, options, pattern, *files = sys.argv[2:]
    run = child(loader, files, device, json.loads(options), keep=pattern == "keep", host=memory == "host")
    print(json.dumps(asdict(run)))
