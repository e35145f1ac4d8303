"""Fetching ahead of a load, in a process of its own: local files into the page cache, object storage
whole into a cache directory that the next load reads locally; a report when it ends; nothing left
running when the process that started it dies."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.commands.bench import evict
from streamload.integrations.startup import prefetch
from tests.cli_runs import cli, one_line_error, small_checkpoint
from tests.servers import RangeServer


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(256, 512, generator=g) for i in range(3)}  # 512 KB each
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_a_local_checkpoint_comes_into_the_page_cache(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m")
    (folder / "notes.safetensors.txt").write_text("not a weight")
    file = folder / "model.safetensors"
    evict([str(file)])
    if _cached(file) > 0.5:
        pytest.skip("this filesystem keeps the pages POSIX_FADV_DONTNEED asks it to drop")
    report = prefetch.fetch(str(folder))
    assert report == {"ok": True, "bytes": file.stat().st_size}
    deadline = time.monotonic() + 20  # the kernel's readahead, asked for, runs on its own
    while _cached(file) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cached(file) == 1.0
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model.safetensors"}}')
    assert prefetch.fetch(str(folder / "model.safetensors.index.json")) == report


def test_object_storage_lands_whole_in_the_cache_dir_and_the_load_reads_it_locally(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "store" / "m")
    server = RangeServer(tmp_path / "store")
    try:
        url, cache = f"{server.url}/m/", tmp_path / "cache"
        assert prefetch.fetch(url, cache)["ok"]
        fetched = server.data_requests()
        assert fetched > 0
        state = streamload.load(url, device="cpu", cache_dir=cache)
        assert server.data_requests() == fetched  # every byte from the cache directory
        reference = load_file(folder / "model.safetensors")
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference)
    finally:
        server.close()


def test_a_checkpoint_over_the_budget_is_not_fetched(tmp_path: Path) -> None:
    report = prefetch.fetch(str(_checkpoint(tmp_path / "m")), budget=1000)
    assert report["ok"] is False and "do not fit the prefetch's budget of 1000 bytes" in str(report["error"])


def test_the_prefetch_command_warms_a_folder_and_names_one_that_is_not_there(tmp_path: Path) -> None:
    folder = small_checkpoint(tmp_path)
    run = cli("prefetch", str(folder), timeout=120)
    assert run.returncode == 0 and f"prefetched {folder}: " in run.stdout, run.stderr
    one_line_error(cli("prefetch", str(tmp_path / "typo"), timeout=120), str(tmp_path / "typo"))


def test_start_reports_through_its_file_and_ends(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m")
    done = tmp_path / "done.json"
    started = prefetch.start(str(folder), done)
    assert _parent(started.pid) != os.getpid()  # not our child: when it ends, no zombie is left with us
    assert prefetch.wait(done, started.pid, timeout=120)["ok"] is True
    _ends(started.pid)
    missing = prefetch.start(str(tmp_path / "nowhere"), tmp_path / "done2.json")
    report = prefetch.wait(tmp_path / "done2.json", missing.pid, timeout=120)
    assert report["ok"] is False and "nowhere" in str(report["error"])  # the loader goes on without it
    _ends(missing.pid)


def _ends(pid: int) -> None:
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid)


def test_waiting_ends_when_the_prefetch_dies_without_a_report(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    report = prefetch.wait(tmp_path / "never.json", sleeper.pid, timeout=60)
    assert report == {"ok": False, "error": f"the prefetch (process {sleeper.pid}) ended without a report"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_prefetch_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "store" / "m")
    server = RangeServer(tmp_path / "store")
    server.faults = ["stall:60"] * 8  # the download hangs: only the parent's death can end it early
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from streamload.integrations.startup import prefetch; "
            "p = prefetch.start(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])); "
            "print(p.pid, flush=True); time.sleep(120)",
            f"{server.url}/m/",
            str(tmp_path / "done.json"),
            str(tmp_path / "cache"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while server.data_requests() == 0 and time.monotonic() < deadline:  # it is downloading
            time.sleep(0.05)
        parent.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only its watch can end it
        parent.wait(10)
        _ends(child)
        assert not (tmp_path / "done.json").exists()
    finally:
        if parent.poll() is None:
            parent.kill()
        server.close()


def _cached(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore of a private mapping of it)."""
    size, page = path.stat().st_size, mmap.PAGESIZE
    pages = -(-size // page)
    residency = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        start = ctypes.c_char.from_buffer(mapped)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), residency) == 0
        finally:
            del start
    return sum(r & 1 for r in residency) / pages


def _alive(pid: int) -> bool:
    return prefetch._alive(pid)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_stopping_never_signals_a_process_that_is_not_a_prefetch(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        prefetch.Prefetch(other.pid, tmp_path / "never.json").stop()  # an id the prefetch had once
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_fetch_from_object_storage_imports_no_torch_and_completes_file_after_file(tmp_path: Path) -> None:
    """The fetch process reads headers and bytes without torch (seconds of imports before its first
    request otherwise), and it fetches the shards in order, so the first is complete (a load waiting
    for it can read it) while later ones still download."""
    store = tmp_path / "store" / "m"
    store.mkdir(parents=True)
    tensors = {f"model.layers.{i}.w": torch.full((256, 1024), float(i)) for i in range(4)}  # 1 MiB each
    for i in range(2):
        save_file(
            {k: v for k, v in tensors.items() if int(k.split(".")[2]) // 2 == i}, str(store / f"s{i}.safetensors")
        )
    index = {"weight_map": {k: f"s{int(k.split('.')[2]) // 2}.safetensors" for k in tensors}}
    (store / "model.safetensors.index.json").write_text(json.dumps(index))
    server = RangeServer(tmp_path / "store", rate=2 << 20)  # 2 MiB a file: a second each, one read at a time
    cache, done = tmp_path / "cache", tmp_path / "done.json"
    code = ("import sys; from streamload.integrations.startup import prefetch; rc = prefetch.main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")  # fmt: skip
    try:
        argv = [f"{server.url}/m/", "--done", str(done), "--cache-dir", str(cache), "--threads", "1"]
        child = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True)
        first, second = (cache / "http" / server.url.split("//")[1].replace(":", "_") / "m" / f"s{i}.safetensors"
                         for i in range(2))  # fmt: skip
        deadline = time.monotonic() + 60
        while not first.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.exists() and not second.exists()  # the first shard complete, the second still under way
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and out.strip() == "False"  # no torch in the fetch process
        state = streamload.load(f"{server.url}/m/", device="cpu", cache_dir=cache)
        assert all(torch.equal(state[k], v) for k, v in tensors.items())
        assert second.read_bytes() == (store / "s1.safetensors").read_bytes()
    finally:
        server.close()


def _ahead_then_killed(tmp_path: Path, url: str, engines: int) -> list[Path]:
    """Processes that start a fetch ahead (as an engine's does), each with a part-written file in its
    staging, all SIGKILLed mid-download: no exit handler runs. Their staging directories."""
    code = (
        "import sys, time; from streamload.integrations.startup import prefetch; s = prefetch.ahead(sys.argv[1]); "
        "open(s['cache_dir'] + '/x.safetensors.partial.h.1.r', 'wb').write(b'half'); "
        "print(s['cache_dir'], s['pid'], flush=True); time.sleep(120)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    running = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(engines)]  # fmt: skip
    try:
        said = [engine.stdout.readline().split() for engine in running if engine.stdout is not None]
        for _, fetch in said:  # a pod's end (OOM, eviction) takes its fetch too: no process of theirs cleans up
            os.kill(int(fetch), signal.SIGKILL)
    finally:
        for engine in running:
            engine.send_signal(signal.SIGKILL)
            engine.wait(10)
    for _, fetch in said:
        _ends(int(fetch))
    return [Path(staged).parent for staged, _ in said]


def test_a_killed_engines_staging_is_removed_by_the_next_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three engines SIGKILLed mid-download leave three staging directories (each would hold a whole
    checkpoint); the next start removes them, partial files included, and keeps the staging of a
    process that runs, also one recorded under a reused process id (another start time) is removed."""
    import tempfile

    from streamload.base import leftovers as owned

    _checkpoint(tmp_path / "store" / "m")
    server = RangeServer(tmp_path / "store")
    server.faults = ["stall:60"] * 64  # downloads hang: the engines die mid-way
    temp = tmp_path / "tmp"
    temp.mkdir()
    try:
        left = _ahead_then_killed(temp, f"{server.url}/m/", 3)
        assert all(p.is_dir() and any(p.rglob("*.partial.*")) for p in left)
        running = subprocess.Popen([sys.executable, "-c", "import sys, time; from streamload.base import leftovers; "
                                    "print(leftovers.make('streamload-prefetch-', sys.argv[1]), flush=True); "
                                    "time.sleep(60)", str(temp)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert running.stdout is not None
            alive = Path(running.stdout.readline().strip())
            reused = owned.make("streamload-prefetch-", temp)  # this process's id, another start time
            record = json.loads((reused / owned.RECORD).read_text())
            (reused / owned.RECORD).write_text(json.dumps({**record, "start": record["start"] - 1}))
            monkeypatch.setattr(tempfile, "tempdir", str(temp))
            monkeypatch.delenv(prefetch.ENV, raising=False)
            started = prefetch.ahead(str(tmp_path / "store" / "m"))  # the next engine's start
            monkeypatch.delenv(prefetch.ENV, raising=False)
            assert not any(p.exists() for p in left) and not reused.exists()
            assert alive.is_dir()
            assert sorted(temp.iterdir()) == sorted([alive, Path(started["done"]).parent])
        finally:
            running.kill()
            running.wait(10)
    finally:
        server.close()


def test_only_the_process_that_starts_the_engine_fetches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm serve --api-server-count N` builds the load config again in each of its API-server
    processes; only the first process (whose config the engine gets) starts a fetch."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from streamload.integrations.vllm import register

    register()
    model = _checkpoint(tmp_path / "m")
    monkeypatch.delenv(prefetch.ENV, raising=False)
    api_server = EngineArgs(model=str(model), load_format="streamload")
    api_server._api_process_count, api_server._api_process_rank = 2, 1
    assert "prefetch" not in api_server.create_load_config().model_loader_extra_config
    first = EngineArgs(model=str(model), load_format="streamload")
    first._api_process_count, first._api_process_rank = 2, -1
    started = first.create_load_config().model_loader_extra_config["prefetch"]
    monkeypatch.delenv(prefetch.ENV, raising=False)
    assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]


def _first_load_rank(rank: int, root: str, fetched: bool) -> None:
    """Rank `rank` of a two-worker engine on vLLM's world group (gloo): its first load, rank 0 with a
    private staging directory fetched ahead, rank 1 on a node whose fetch could not start."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.distributed import init_distributed_environment

    from streamload.integrations.vllm import StreamloadModelLoader
    from streamload.integrations.vllm.startup import ahead

    with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(cpu_distributed_timeout_seconds=20))):
        init_distributed_environment(2, rank, f"file://{root}/pg", rank, "gloo")
    staging = Path(root, "staging")
    started = {"cache_dir": str(staging), "owned": True, "host": "", "done": f"{root}/done.json"} if fetched else None
    if started is not None:
        import socket

        started["host"] = socket.gethostname()
    loader = StreamloadModelLoader(LoadConfig(load_format="streamload"))
    began = time.monotonic()
    try:
        ahead.load_from_staging(loader.state, started, lambda: None)
        said = "ok"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    Path(root, f"rank{rank}.json").write_text(json.dumps({"said": said, "seconds": time.monotonic() - began}))
    os._exit(0)


def test_a_node_whose_fetch_could_not_start_still_joins_the_barrier(tmp_path: Path) -> None:
    """On several nodes each node's engine process starts its own fetch: where one could not start,
    its ranks still join the barrier after the first load, and the rank whose staging it is removes it
    once every rank is past the load (before: the one waited for a peer that never came)."""
    pytest.importorskip("vllm")
    import multiprocessing as mp

    from streamload.integrations.vllm import StreamloadModelLoader  # noqa: F401  (imported once, before the fork)

    (tmp_path / "staging").mkdir()
    (tmp_path / "done.json").write_text('{"ok": true, "bytes": 0}')
    context = mp.get_context("fork")
    ranks = [context.Process(target=_first_load_rank, args=(r, str(tmp_path), r == 0)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=120)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(5)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["said"] for r in results] == ["ok", "ok"], results
    assert all(r["seconds"] < 15 for r in results), results  # not the group's timeout (20 s)
    assert not (tmp_path / "staging").exists()
