"""The staging cap and streams used in turn by one consumer: `zip(iter(a), iter(b))` must not wait for ever.

A stream's first slot waits for staging that other streams give back. Streams whose consumer is the one
waiting (the same thread, or the same async task) can never give it back, so their holdings must not
make it wait; streams of other threads still share the cap as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload

from .conftest import same_bits
from .test_stress import Watch

pytestmark = pytest.mark.anyio
MiB = 1 << 20
CAP = 8 * MiB
RING = {"device": "cpu", "reader": "posix", "ring_bytes": "8MiB"}  # 4 slots of 2 MiB: one stream can hold the cap
SLOT = 2 * MiB
TIMEOUT = 60.0  # seconds: a load of these files takes well under one; a wait for ever fails instead of hanging


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four checkpoints of 12 tensors of 1 MiB: six slots' worth each."""
    paths = []
    for k in range(4):
        path = tmp_path_factory.mktemp(f"same{k}") / "m.safetensors"
        g = torch.Generator().manual_seed(k)
        save_file({f"layers.{i}.w": torch.randn(256, 1024, generator=g) for i in range(12)}, path)
        paths.append(path)
    return paths


@pytest.fixture
def cap() -> Iterator[int]:
    """An 8 MiB staging cap for the whole process, the limits of before restored afterwards."""
    before = streamload.usage()
    streamload.set_limits(staging_bytes=CAP)
    streamload.usage(reset_peak=True)
    try:
        yield CAP
    finally:
        streamload.set_limits(reader_threads=before.reader_threads, staging_bytes=before.staging_cap)


def equal_to_files(got: dict[str, torch.Tensor], path: Path) -> bool:
    ref = load_file(path)
    return got.keys() == ref.keys() and all(same_bits(got[n], t) for n, t in ref.items())


def run_bounded(targets: list[Callable[[], None]], streams: list[streamload.TensorStream]) -> None:
    """Run each target in a thread of its own; a thread still running after TIMEOUT fails the test, once
    its streams are closed (which ends a wait for staging) and every thread has ended."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # handed to the test's thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    for s in streams:
        s.close()
    for t in threads:
        t.join()
    assert not hung, f"{hung} of {len(threads)} threads still waited after {TIMEOUT} s (for staging)"
    if errors:
        raise errors[0]


def test_two_streams_zipped_in_one_thread_finish(files: list[Path], cap: int) -> None:
    a, b = (streamload.iter(p, **RING) for p in files[:2])
    got: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    seen: list[streamload.Usage] = []

    def zipped() -> None:
        for (na, ta), (nb, tb) in zip(a, b, strict=True):
            got[0][na], got[1][nb] = ta, tb
            seen.append(streamload.usage())

    run_bounded([zipped], [a, b])
    assert equal_to_files(got[0], files[0]) and equal_to_files(got[1], files[1])
    first = seen[0]  # `a` holds the whole cap; `b` took its one first slot beyond it, and said so
    assert first.staging_over == SLOT and first.staging_bytes == cap + SLOT
    assert all(u.staging_bytes <= u.staging_cap + u.staging_over for u in seen)
    after = streamload.usage()
    assert after.staging_bytes == after.staging_over == after.staging_waiting == 0
    assert after.staging_peak == cap + SLOT  # beyond the cap by that one slot, never more


async def test_two_async_streams_interleaved_in_one_task_finish(files: list[Path], cap: int) -> None:
    got: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    with anyio.fail_after(TIMEOUT):  # cancels the waiting call: the stream stops, the worker thread returns
        async with streamload.iter(files[0], **RING) as a, streamload.iter(files[1], **RING) as b:
            while True:  # an async zip: one task takes a tensor of each in turn
                try:
                    na, ta = await a.__anext__()
                    nb, tb = await b.__anext__()
                except StopAsyncIteration:
                    break
                got[0][na], got[1][nb] = ta, tb
                usage = streamload.usage()
                assert usage.staging_bytes <= usage.staging_cap + usage.staging_over
                assert usage.staging_over == SLOT  # `b`'s first slot, beyond the cap `a` holds all of
    assert equal_to_files(got[0], files[0]) and equal_to_files(got[1], files[1])
    assert streamload.usage().staging_bytes == streamload.usage().staging_over == 0


def wait_for(what: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT / 2  # within run_bounded's time
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_streams_of_other_threads_still_share_the_cap(files: list[Path], cap: int) -> None:
    a, b = (streamload.iter(p, **RING) for p in files[:2])
    holding, go = threading.Event(), threading.Event()
    got: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})

    def first() -> None:  # holds the whole cap, then pauses: its thread is busy elsewhere, not waiting
        name, t = next(a)
        got[0][name] = t
        holding.set()
        assert go.wait(TIMEOUT)
        got[0].update(a)

    def second() -> None:
        assert holding.wait(TIMEOUT)
        got[1].update(b)

    def check_the_wait() -> None:  # `b` waits for `a`'s thread: not beyond the cap
        try:
            assert holding.wait(TIMEOUT)
            wait_for(lambda: streamload.usage().staging_waiting == 1 or b.stats.bytes_read > 0)
            time.sleep(0.2)  # time enough to take a slot wrongly
            usage = streamload.usage()
            assert usage.staging_waiting == 1 and usage.staging_over == 0 and usage.staging_bytes == cap
            assert b.stats.bytes_read == 0
        finally:
            go.set()

    with Watch() as watch:
        run_bounded([first, second, check_the_wait], [a, b])
    assert equal_to_files(got[0], files[0]) and equal_to_files(got[1], files[1])
    assert watch.over == 0 and SLOT <= watch.staging <= streamload.usage().staging_peak <= cap
    assert a.stats.staging_bytes + b.stats.staging_bytes > cap  # so the two did share the cap


def test_threads_each_waiting_on_the_other_do_not_wait_for_ever(files: list[Path], cap: int) -> None:
    """Each of two threads holds half the cap and opens a second stream: neither can give back what the
    other waits for, so one of them takes its first slot beyond the cap, and both finish."""
    ring = {**RING, "ring_bytes": "4MiB", "slots": 2}  # 2 MiB slots, two per stream: two streams fill the cap
    streams = [streamload.iter(p, **ring) for p in files]
    both_hold = threading.Barrier(2, timeout=TIMEOUT)
    got: list[dict[str, torch.Tensor]] = [{} for _ in files]

    def pair(i: int) -> Callable[[], None]:
        def run() -> None:
            held, second = streams[i], streams[i + 2]
            name, t = next(held)
            got[i][name] = t
            both_hold.wait()  # the cap is full, held by the two threads
            for (n1, t1), (n2, t2) in zip(held, second, strict=False):  # `held` ends first: one tensor was taken
                got[i][n1], got[i + 2][n2] = t1, t2
            got[i + 2].update(second)

        return run

    with Watch() as watch:
        run_bounded([pair(0), pair(1)], streams)
    assert all(equal_to_files(g, p) for g, p in zip(got, files, strict=True))
    assert watch.over == SLOT and watch.staging <= cap + SLOT  # one first slot beyond the cap, one thread's
    assert streamload.usage().staging_bytes == streamload.usage().staging_over == 0


def test_the_cap_takes_a_size_with_a_unit(cap: int) -> None:
    streamload.set_limits(staging_bytes="16MiB")
    assert streamload.usage().staging_cap == 16 * MiB
    with pytest.raises(ValueError, match="staging_bytes"):
        streamload.set_limits(staging_bytes="8 parsecs")
