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
from streamload import prefetch
from streamload.bench import evict
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
            "import sys, time; from pathlib import Path; from streamload import prefetch; "
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
    code = ("import sys; from streamload import prefetch; rc = prefetch.main(sys.argv[1:]); "
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
