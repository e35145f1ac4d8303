"""A cache directory filled and read by several processes at once (`storage/cache.py`): real processes
(`python -m streamload.prefetch`, as servers start it), a store capped per connection, SIGKILL at
several points of a write. Every copy that looks complete is the store's file byte for byte, and every
later load is bit-exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload

from .conftest import random_tensor, same_bits
from .servers import RangeServer

pytest.importorskip("obstore")
RATE = 2 << 20  # bytes a second per connection: a fetch of the checkpoint takes about a second
DEADLINE = 60.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two shards of 2 MB (each layer's tensors in one shard), served from `store/model/`."""
    root = tmp_path_factory.mktemp("store")
    model = root / "model"
    model.mkdir()
    index: dict[str, str] = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {
            f"model.layers.{layer}.{w}": random_tensor(torch.bfloat16, (256, 1024), seed=10 * layer + k)
            for layer in range(4 * (shard - 1), 4 * shard)
            for k, w in enumerate(("up.weight", "down.weight"))
        }
        save_file(tensors, model / name)
        index.update(dict.fromkeys(tensors, name))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return root


@pytest.fixture
def server(store: Path) -> Iterator[RangeServer]:
    s = RangeServer(store, rate=RATE)
    yield s
    s.close()


def data_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in (store / "model").glob("*.safetensors"))


def reference(store: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted((store / "model").glob("*.safetensors")) for n, t in load_file(f).items()}


def prefetch(url: str, cache: Path, done: Path) -> subprocess.Popen[bytes]:
    """`python -m streamload.prefetch`, reporting into `done` (kept as the process's `done`)."""
    cmd = [sys.executable, "-m", "streamload.prefetch", url, "--done", str(done), "--cache-dir", str(cache)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.done = done  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 0, err.decode()
    return json.loads(proc.done.read_text())  # type: ignore[attr-defined]


def wait_until(what: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not what():
        if proc.poll() is not None:
            assert what(), f"the fetch ended first: {proc.stderr.read().decode() if proc.stderr else ''}"
            return
        assert time.monotonic() < deadline
        time.sleep(0.005)


def copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.name.endswith(".safetensors"))


def assert_cache_holds_only_whole_copies(cache: Path, store: Path) -> None:
    """Whatever has a copy's name is the store's file, byte for byte; nothing else is left but locks
    and the partial files of writers that were killed (never under a copy's name)."""
    for copy in copies(cache):
        assert copy.read_bytes() == (store / "model" / copy.name).read_bytes(), copy
    for p in cache.rglob("*"):
        assert (
            p.is_dir()
            or p.name.endswith((".safetensors", ".streamload.json", ".lock", ".json"))
            or ".partial." in p.name
        )


def assert_later_loads_exact(url: str, cache: Path, store: Path) -> None:
    ref = reference(store)
    for _ in range(2):  # the first may still complete the copies, the second reads them
        got = streamload.load(url, device="cpu", cache_dir=cache)
        assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    with streamload.iter(url, device="cpu", cache_dir=cache) as stream:
        assert stream.stats.reader == "mmap"  # complete and local now
        got = dict(stream)
    assert all(same_bits(got[n], ref[n]) for n in ref)
    assert_cache_holds_only_whole_copies(cache, store)


def start_two(url: str, cache: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Two fetches started at once (as servers on one node are): (the writer, the one that waits for it),
    told apart by the writer's partial files, which carry its process id."""
    both = [prefetch(url, cache, tmp_path / f"{i}.json") for i in range(2)]
    partials = lambda: [p.name for p in cache.rglob("*.partial.*")]  # noqa: E731
    wait_until(lambda: bool(partials()), both[0])
    pid = int(partials()[0].split(".partial.", 1)[1].split(".")[-2])
    writer = next(p for p in both if p.pid == pid)
    return writer, next(p for p in both if p is not writer)


def test_two_fetches_into_one_cache_download_once(server: RangeServer, store: Path, tmp_path: Path) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    both = start_two(url, cache, tmp_path)
    assert all(finish(p)["ok"] is True for p in both)
    assert len(copies(cache)) == 2
    assert server.sent <= 1.05 * data_bytes(store)  # the second read the first's copies, not the store
    assert_later_loads_exact(url, cache, store)


@pytest.mark.parametrize(
    ("killed", "point"), [("writer", "10%"), ("writer", "first-copy"), ("writer", "80%"), ("waiter", "50%")]
)
def test_a_fetch_killed_at_any_point_leaves_nothing_that_looks_complete(
    server: RangeServer, store: Path, tmp_path: Path, killed: str, point: str
) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    total = data_bytes(store)
    writer, waiter = start_two(url, cache, tmp_path)
    victim, survivor = (writer, waiter) if killed == "writer" else (waiter, writer)
    if point == "first-copy":
        wait_until(lambda: len(copies(cache)) >= 1, writer)
    else:
        wait_until(lambda: server.sent >= float(point[:-1]) / 100 * total, writer)
    assert writer.poll() is None, "the writer ended before the point"
    victim.send_signal(signal.SIGKILL)
    victim.wait(DEADLINE)
    assert victim.returncode == -signal.SIGKILL
    got = finish(survivor)
    assert got["ok"] is True, got
    assert_cache_holds_only_whole_copies(cache, store)
    assert_later_loads_exact(url, cache, store)


def test_a_load_reads_while_a_fetch_writes(server: RangeServer, store: Path, tmp_path: Path) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    ref = reference(store)
    writer = prefetch(url, cache, tmp_path / "a.json")
    wait_until(lambda: server.sent > 0, writer)
    got = streamload.load(url, device="cpu", cache_dir=cache)  # waits for the copies as it needs them
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    assert finish(writer)["ok"] is True
    assert server.sent <= 1.05 * data_bytes(store)
    assert_later_loads_exact(url, cache, store)


def test_the_old_shared_partial_is_cleaned_and_never_taken_for_a_copy(
    server: RangeServer, store: Path, tmp_path: Path
) -> None:
    """A killed writer's partial file, and a copy under a record of another inode (a file put there by
    hand, or by an older writer): neither counts as complete; the next writer replaces both."""
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    streamload.load(url, device="cpu", cache_dir=cache)
    first = copies(cache)[0]
    stale = Path(f"{first}.partial.otherhost.1.abcd")
    stale.write_bytes(b"\0" * 1000)
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.unlink()
    first.write_bytes(bytes(data))  # the same size under the old record: another inode
    with streamload.iter(url, device="cpu", cache_dir=cache) as stream:
        assert stream.stats.reader == "range"
        got = dict(stream)
    ref = reference(store)
    assert all(same_bits(got[n], ref[n]) for n in ref)
    assert not stale.exists()
    assert_later_loads_exact(url, cache, store)


def test_no_lock_or_descriptor_outlives_a_load(server: RangeServer, store: Path, tmp_path: Path) -> None:
    from streamload.storage import cache as cache_module

    url, cache = f"{server.url}/model/", tmp_path / "cache"

    def open_in_cache() -> list[str]:
        fds = Path("/proc/self/fd")
        return [t for t in (os.path.realpath(fds / fd) for fd in os.listdir(fds)) if t.startswith(str(cache))]

    streamload.load(url, device="cpu", cache_dir=cache, include="model.layers.0.*")  # reads shard 1 in part
    assert not open_in_cache() and not cache_module._held
    assert not copies(cache)  # shard 1 read in part is not kept (shard 2 was not read)
    streamload.load(url, device="cpu", cache_dir=cache)
    streamload.load(url, device="cpu", cache_dir=cache)
    assert not open_in_cache() and not cache_module._held
