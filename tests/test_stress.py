"""Cancellation at random points, many streams at once, and backpressure from a slow consumer."""

from __future__ import annotations

import gc
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.pipeline import Tuning

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
        # Read ahead of the consumer: at most the ring, the tensors waiting for it, and the one taken.
        ahead = stream.stats.bytes_read - tensor_bytes
        assert ahead <= RING["ring_bytes"] + (Tuning.buffer + 1) * tensor_bytes
        assert stream.stats.bytes_read < stream.stats.bytes_total
        list(stream)
