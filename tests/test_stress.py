"""Cancellation at random points, many streams at once, and backpressure from a slow consumer."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload

from .conftest import open_fds, own_threads, same_bits

pytestmark = pytest.mark.anyio
RING = {"ring_bytes": 128 * 1024, "slots": 2, "chunk_bytes": 16 * 1024}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    paths = []
    for k in range(16):
        path = tmp_path_factory.mktemp(f"c{k}") / "m.safetensors"
        g = torch.Generator().manual_seed(k)
        save_file({f"layers.{i}.w": torch.randn(64, 64 + k, generator=g) for i in range(12)}, path)
        paths.append(path)
    return paths


async def test_cancel_and_break_at_random_points(checkpoints: list[Path]) -> None:
    rng = random.Random(0)
    fds, threads = open_fds(), own_threads()
    slowest = 0.0
    for i in range(150):
        path, stop_after = rng.choice(checkpoints), rng.randrange(0, 12)
        reader = rng.choice(["mmap", "posix"])
        mode = rng.choice(["break", "cancel", "timeout"])
        with anyio.move_on_after(rng.uniform(0, 0.01) if mode == "timeout" else 10) as scope:
            async with streamload.iter(path, device="cpu", reader=reader, **RING) as stream:
                n = 0
                async for _ in stream:
                    n += 1
                    if n > stop_after:
                        if mode == "cancel":
                            scope.cancel()
                            await anyio.sleep(0)
                        break
                started = time.perf_counter()
        slowest = max(slowest, time.perf_counter() - started) if mode == "break" else slowest
        assert not (mode == "break" and scope.cancelled_caught), i
    gc.collect()
    assert open_fds() <= fds and own_threads() <= threads
    assert slowest < 1.0


def test_break_sync_at_random_points(checkpoints: list[Path]) -> None:
    rng = random.Random(1)
    fds, threads = open_fds(), own_threads()
    for _ in range(100):
        with streamload.iter(rng.choice(checkpoints), device="cpu", reader=rng.choice(["mmap", "posix"]), **RING) as s:
            for k, _item in enumerate(s):
                if k == rng.randrange(0, 12):
                    break
    gc.collect()
    assert open_fds() <= fds and own_threads() <= threads


def test_sixteen_loads_at_once_from_threads(checkpoints: list[Path]) -> None:
    def one(path: Path) -> bool:
        got = streamload.load(path, device="cpu", reader="posix", **RING)
        return all(same_bits(got[n], t) for n, t in load_file(path).items())

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(one, checkpoints))


async def test_sixteen_loads_at_once_in_one_event_loop(checkpoints: list[Path]) -> None:
    results: dict[Path, dict[str, torch.Tensor]] = {}

    async def one(path: Path) -> None:
        async with streamload.iter(path, device="cpu", **RING) as stream:
            results[path] = {n: t async for n, t in stream}

    async with anyio.create_task_group() as tg:
        for path in checkpoints:
            tg.start_soon(one, path)
    for path in checkpoints:
        ref = load_file(path)
        assert all(same_bits(results[path][n], t) for n, t in ref.items())


def test_slow_consumer_applies_backpressure(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"layers.{i}.w": torch.ones(128, 128) * i for i in range(40)}, path)  # 2.6 MB, 64 KiB each
    tensor_bytes = max(t.nbytes for t in streamload.inspect(path).tensors.values())
    with streamload.iter(path, device="cpu", reader="posix", **RING) as stream:
        next(stream)
        time.sleep(0.3)  # a consumer busy elsewhere: the pipeline must stop reading, not run ahead
        # Read ahead of the consumer: at most the ring (no tensor is made before it is asked for).
        ahead = stream.stats.bytes_read - tensor_bytes
        assert ahead <= RING["ring_bytes"] + tensor_bytes
        assert stream.stats.bytes_read < stream.stats.bytes_total
        list(stream)


SLOT = RING["ring_bytes"] // RING["slots"]


@pytest.fixture
def tight_limits() -> Iterator[streamload.Usage]:
    """Three reader threads and five slots of staging for the whole process."""
    before = streamload.usage()
    streamload.set_limits(reader_threads=3, staging_bytes=5 * SLOT)
    streamload.usage(reset_peak=True)
    yield streamload.usage()
    streamload.set_limits(reader_threads=before.reader_threads, staging_bytes=before.staging_cap)


class Watch:
    """Samples the reader threads alive, the staging held and the most held beyond the cap while loads run."""

    def __init__(self) -> None:
        self.threads = self.staging = self.over = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            readers = sum(t.name.startswith("streamload-read") for t in threading.enumerate())
            self.threads = max(self.threads, readers)
            usage = streamload.usage()
            self.staging = max(self.staging, usage.staging_bytes)
            self.over = max(self.over, usage.staging_over)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def check_shared_limits(watch: Watch, limits: streamload.Usage, stats: list[streamload.Stats]) -> None:
    after = streamload.usage()
    assert 0 < watch.threads <= limits.reader_threads  # one pool for all sixteen streams
    assert SLOT <= watch.staging <= after.staging_peak <= limits.staging_cap  # the cap held throughout
    assert all(SLOT <= s.staging_bytes <= RING["ring_bytes"] for s in stats)  # each got a slot, none more than its ring
    assert sum(s.staging_bytes for s in stats) > limits.staging_cap  # so the streams did share the budget
    assert after.staging_bytes == 0 and after.streams == 0  # all given back, the pool idle
    assert not any(t.name.startswith("streamload-read") for t in threading.enumerate())


def test_sixteen_loads_share_one_reader_pool_and_staging_cap(
    checkpoints: list[Path], tight_limits: streamload.Usage
) -> None:
    def one(path: Path) -> streamload.Stats:
        with streamload.iter(path, device="cpu", reader="posix", **RING) as stream:
            got = dict(stream)
        assert all(same_bits(got[n], t) for n, t in load_file(path).items())
        return stream.stats

    with Watch() as watch, ThreadPoolExecutor(16) as pool:
        stats = list(pool.map(one, checkpoints))
    check_shared_limits(watch, tight_limits, stats)


async def test_sixteen_loads_in_one_event_loop_share_the_limits(
    checkpoints: list[Path], tight_limits: streamload.Usage
) -> None:
    stats: list[streamload.Stats] = []

    async def one(path: Path) -> None:
        async with streamload.iter(path, device="cpu", reader="posix", **RING) as stream:
            got = {n: t async for n, t in stream}
        assert all(same_bits(got[n], t) for n, t in load_file(path).items())
        stats.append(stream.stats)

    with Watch() as watch:
        async with anyio.create_task_group() as tg:
            for path in checkpoints:
                tg.start_soon(one, path)
    check_shared_limits(watch, tight_limits, stats)


async def test_a_stream_waiting_for_staging_can_be_cancelled(checkpoints: list[Path]) -> None:
    before = streamload.usage()
    streamload.set_limits(staging_bytes=SLOT)
    try:
        # Opened and read by another thread: a stream waits only for staging that others can give back
        # (one this task opened and holds would never be: its first slot would be taken beyond the cap).
        opened = anyio.to_thread.run_sync(lambda: streamload.iter(checkpoints[0], device="cpu", reader="posix", **RING))
        with await opened as holder:
            await anyio.to_thread.run_sync(next, holder)  # holds the only slot there is
            with anyio.move_on_after(0.2) as scope:
                async with streamload.iter(checkpoints[1], device="cpu", reader="posix", **RING) as waiting:
                    await waiting.__anext__()
            assert scope.cancelled_caught and waiting.stats.bytes_read == 0
            assert streamload.usage().staging_bytes == SLOT
        assert streamload.usage().staging_bytes == 0
        got = streamload.load(checkpoints[1], device="cpu", reader="posix", **RING)  # the slot is free again
        assert all(same_bits(got[n], t) for n, t in load_file(checkpoints[1]).items())
    finally:
        streamload.set_limits(staging_bytes=before.staging_cap)


def test_a_slot_larger_than_the_cap_is_a_clear_error(checkpoints: list[Path]) -> None:
    before = streamload.usage()
    streamload.set_limits(staging_bytes=SLOT)
    try:
        with pytest.raises(ValueError, match="larger than the process-wide staging cap"):
            streamload.iter(checkpoints[0], device="cpu", reader="posix", ring_bytes=4 * SLOT, slots=2)
    finally:
        streamload.set_limits(staging_bytes=before.staging_cap)
    with pytest.raises(ValueError, match="reader_threads"):
        streamload.set_limits(reader_threads=0)
