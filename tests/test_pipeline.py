"""The pipeline's behaviour: async and sync faces, streaming, errors, early exit and cleanup."""

from __future__ import annotations

import errno
import gc
import os
import weakref
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.base.limits import shared_limits
from streamload.device import StagedCPU

from .conftest import open_fds, own_threads, random_tensor, same_bits

pytestmark = pytest.mark.anyio
RING = {"ring_bytes": 256 * 1024, "slots": 2, "chunk_bytes": 32 * 1024}  # forces many batches


@pytest.fixture
def model(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    save_file(
        {f"model.layers.{i}.w": torch.randn(128, 256, generator=g) for i in range(16)}, tmp_path / "m.safetensors"
    )
    return tmp_path / "m.safetensors"


@pytest.mark.parametrize("reader", ["mmap", "posix", "direct"])
async def test_async_with(model: Path, reader: str) -> None:
    ref = load_file(model)
    async with streamload.iter(model, device="cpu", reader=reader, **RING) as stream:
        got = {name: t async for name, t in stream}
    assert got.keys() == ref.keys() and all(same_bits(got[k], ref[k]) for k in ref)
    assert stream.stats.tensors_done == 16 and stream.stats.bytes_read == stream.stats.bytes_total
    assert stream.stats.time_to_first_tensor is not None and stream.stats.elapsed > 0


async def test_bare_async_for(model: Path) -> None:
    ref = load_file(model)
    got = {name: t async for name, t in streamload.iter(model, device="cpu", **RING)}
    assert all(same_bits(got[k], ref[k]) for k in ref)


def test_sync_for_and_with(model: Path) -> None:
    ref = load_file(model)
    assert all(same_bits(t, ref[n]) for n, t in streamload.iter(model, device="cpu", **RING))
    with streamload.iter(model, device="cpu", reader="posix", **RING) as stream:
        assert [n for n, _ in stream] == sorted(ref, key=lambda n: int(n.split(".")[2]))


def test_stream_runs_once(model: Path) -> None:
    stream = streamload.iter(model, device="cpu")
    list(stream)
    with pytest.raises(streamload.StreamloadError, match="runs once"):
        list(stream)


async def test_tensors_arrive_before_the_last_byte(model: Path) -> None:
    async with streamload.iter(model, device="cpu", reader="posix", **RING) as stream:
        async for _name, _t in stream:
            first_seen = stream.stats.bytes_read
            break
    # With a 256 KiB ring, the first tensor is handed out long before the 2 MiB are read.
    assert first_seen <= 256 * 1024 + 128 * 256 * 4 < stream.stats.bytes_total


@pytest.mark.parametrize("reader", ["mmap", "posix", "direct"])
async def test_error_in_read_stage_reaches_consumer(model: Path, reader: str) -> None:
    stream = streamload.iter(model, device="cpu", reader=reader, **RING)
    os.truncate(model, model.stat().st_size // 2)  # after the header was read
    with pytest.raises(streamload.StreamloadError, match=str(model)):
        async with stream:
            async for _ in stream:
                pass


def test_error_in_instantiate_stage_reaches_sync_consumer(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = StagedCPU.instantiate

    def failing(self, batch, slot, files):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device fell over")
        return real(self, batch, slot, files)

    monkeypatch.setattr(StagedCPU, "instantiate", failing)
    seen = []
    with pytest.raises(streamload.StreamloadError, match="device fell over") as info:
        for name, _ in streamload.iter(model, device="cpu", reader="posix", **RING):
            seen.append(name)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert str(model) in str(info.value)
    assert 0 < len(seen) < 16  # what arrived before the failure was handed out


async def test_consumer_error_propagates_unwrapped(model: Path) -> None:
    with pytest.raises(KeyError, match="mine"):
        async with streamload.iter(model, device="cpu", **RING) as stream:
            async for _ in stream:
                raise KeyError("mine")


def _leaks_nothing(run) -> None:  # type: ignore[no-untyped-def]
    fds, threads = open_fds(), own_threads()
    run()
    gc.collect()
    assert open_fds() <= fds
    assert own_threads() <= threads


@pytest.mark.parametrize("reader", ["mmap", "posix", "direct"])
def test_break_in_sync_loop_cleans_up(model: Path, reader: str) -> None:
    def run() -> None:
        for _ in streamload.iter(model, device="cpu", reader=reader, **RING):
            break

    _leaks_nothing(run)

    def run_with() -> None:
        with streamload.iter(model, device="cpu", reader=reader, **RING) as stream:
            next(iter(stream))

    _leaks_nothing(run_with)


async def test_break_in_async_loop_cleans_up(model: Path) -> None:
    fds = open_fds()
    async with streamload.iter(model, device="cpu", reader="posix", **RING) as stream:
        async for _ in stream:
            break
    assert open_fds() <= fds
    async for _ in streamload.iter(model, device="cpu", **RING):
        break
    gc.collect()
    assert open_fds() <= fds


async def test_an_idle_worker_thread_does_not_keep_a_dropped_stream(model: Path) -> None:
    stream = streamload.iter(model, device="cpu", **RING)
    async for _ in stream:
        break  # a bare loop: the stream is closed when it is dropped
    ref = weakref.ref(stream)
    with pytest.warns(ResourceWarning, match="left open"):
        del stream
        gc.collect()
    assert ref() is None


async def test_cancelling_the_consumer_stops_the_pipeline(model: Path) -> None:
    fds = open_fds()
    got = 0
    with anyio.move_on_after(5) as outer:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                nonlocal got
                async with streamload.iter(model, device="cpu", reader="posix", **RING) as stream:
                    async for _ in stream:
                        got += 1
                        if got == 2:
                            tg.cancel_scope.cancel()
                        await anyio.sleep(0)

            tg.start_soon(consume)
    assert not outer.cancelled_caught and got >= 2
    assert open_fds() <= fds


def test_stats_live_and_final(model: Path) -> None:
    with streamload.iter(model, device="cpu", reader="posix", **RING) as stream:
        assert stream.stats.tensors_total == 16 and stream.stats.reader == "posix" and stream.stats.device == "cpu"
        next(stream)
        mid = stream.stats.tensors_done
        rest = list(stream)
    assert mid >= 1 and len(rest) == 15
    elapsed = stream.stats.elapsed
    assert stream.stats.tensors_done == 16 and stream.stats.elapsed == elapsed  # frozen once finished


def test_stats_print_elapsed(model: Path) -> None:
    with streamload.iter(model, device="cpu") as stream:
        list(stream)
    text = repr(stream.stats)
    assert f"elapsed={stream.stats.elapsed:.4f}" in text and "tensors_done=16/16" in text and "reader='mmap'" in text


def test_load_from_inside_an_event_loop(model: Path) -> None:
    async def main() -> dict[str, torch.Tensor]:
        return streamload.load(model, device="cpu")  # the sync face runs its own loop on a thread

    assert anyio.run(main).keys() == load_file(model).keys()


@pytest.mark.parametrize("reader", ["mmap", "posix", "direct"])
def test_file_truncated_mid_stream(model: Path, reader: str) -> None:
    got = 0
    with pytest.raises(streamload.ReadError, match=str(model)):
        with streamload.iter(model, device="cpu", reader=reader, **RING) as stream:
            for _ in stream:
                got += 1
                if got == 1:
                    os.truncate(model, 4096)
    assert got < 16


def test_abandoned_sync_stream_warns_and_cleans_up(model: Path) -> None:
    fds = open_fds()
    stream = streamload.iter(model, device="cpu", **RING)
    next(stream)
    with pytest.warns(ResourceWarning, match="left open"):
        del stream
        gc.collect()
    assert open_fds() <= fds


def test_out_of_memory_allocating_a_tensor(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.device import base

    real, calls = base.Assembler._allocate, 0

    def failing(self, item):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 4:
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        return real(self, item)

    monkeypatch.setattr(base.Assembler, "_allocate", failing)
    fds, threads = open_fds(), own_threads()
    with pytest.raises(streamload.StreamloadError, match="out of memory") as info:
        streamload.load(model, device="cpu", reader="posix", **RING)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError) and str(model) in str(info.value)
    gc.collect()
    assert open_fds() <= fds and own_threads() <= threads


@pytest.mark.parametrize("reader", ["mmap", "posix", "direct"])
def test_file_replaced_after_its_header_was_read(model: Path, tmp_path: Path, reader: str) -> None:
    stream = streamload.iter(model, device="cpu", reader=reader, **RING)
    other = tmp_path / "other.safetensors"
    g = torch.Generator().manual_seed(9)
    save_file({f"model.layers.{i}.w": torch.randn(128, 256, generator=g) for i in range(16)}, other)
    assert other.stat().st_size == model.stat().st_size  # same size: only the identity check can tell
    os.replace(other, model)
    with pytest.raises(streamload.ReadError, match="replaced or modified"):
        with stream:
            list(stream)


class FlakyOs:
    """`os` for the posix reader, whose `preadv` fails transiently and reads short, in turn (not EINTR:
    `os.preadv` retries that itself, PEP 475)."""

    def __init__(self, always: type[OSError] | None = None) -> None:
        self.always = always
        self.seen: dict[str, int] = {"eagain": 0, "short": 0, "full": 0}

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if self.always is not None:
            raise self.always(errno.EAGAIN, "Resource temporarily unavailable")
        kind = ("eagain", "short", "full")[sum(self.seen.values()) % 3]
        self.seen[kind] += 1
        if kind == "eagain":
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        if kind == "short":  # a part of the first buffer only
            first = buffers[0]
            return os.preadv(fd, [first[: max(1, len(first) // 3)]], offset)
        return os.preadv(fd, buffers, offset)

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)


def test_transient_errors_and_short_reads_are_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"layers.{i}.w": random_tensor(torch.float32, (33, 17 + i), seed=i) for i in range(20)}, path)
    flaky = FlakyOs()
    monkeypatch.setattr(streamload.read.posix, "os", flaky)
    got = streamload.load(path, device="cpu", reader="posix", ring_bytes=16384, slots=2, chunk_bytes=4096)
    assert all(same_bits(got[n], t) for n, t in load_file(path).items())
    assert min(flaky.seen.values()) >= 10  # every kind happened, many times


def test_a_read_failing_transiently_forever_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(100)}, path)
    monkeypatch.setattr(streamload.read.posix, "os", FlakyOs(always=BlockingIOError))
    monkeypatch.setattr(streamload.read.posix, "_BACKOFF", 0.0)
    with pytest.raises(streamload.ReadError, match=r"m\.safetensors: reading at offset \d+ failed: .*\(100 times in"):
        streamload.load(path, device="cpu", reader="posix")


@pytest.mark.parametrize("reader", ["mmap", "posix", "direct"])
def test_closing_releases_every_tensor_and_buffer(model: Path, reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed stream that the caller keeps (for its stats, say) holds no tensor, slot or mapping."""
    from streamload.device import MappedCPU

    made: list[weakref.ref[torch.Tensor]] = []
    device = MappedCPU if reader == "mmap" else StagedCPU
    real_slot, real_made = device.new_slot, device.instantiate

    def new_slot(self, nbytes):  # type: ignore[no-untyped-def]
        slot = real_slot(self, nbytes)
        if slot is not None:
            made.append(weakref.ref(slot))
        return slot

    def instantiate(self, batch, slot, files):  # type: ignore[no-untyped-def]
        out = real_made(self, batch, slot, files)
        made.extend(weakref.ref(t) for _, t in out)
        return out

    monkeypatch.setattr(device, "new_slot", new_slot)
    monkeypatch.setattr(device, "instantiate", instantiate)
    stream = streamload.iter(model, device="cpu", reader=reader, ring_bytes=1 << 20, slots=2, chunk_bytes=1 << 16)
    with stream:
        _, kept = next(stream)
    assert len(made) > 2  # slots and a batch of several tensors were made; one was handed out
    gc.collect()
    kept_slots = {id(t) for slots in shared_limits().host._free.values() for t in slots}  # for later streams
    alive = [t for r in made if (t := r()) is not None and id(t) not in kept_slots]
    assert len(alive) == 1 and alive[0] is kept
    assert stream.stats.tensors_done == 1
    del kept, alive
    shared_limits().host.trim(0)
    gc.collect()
    assert all(r() is None for r in made)  # and the one handed out was the caller's alone


def test_closing_a_layer_stream_drops_incomplete_groups(model: Path) -> None:
    groups = streamload.layers(model, device="cpu", reader="posix", key=lambda n: n if n.endswith(".1.w") else "all")
    seen: list[weakref.ref[torch.Tensor]] = []
    with groups:
        for _key, _tensors in groups:
            break
        seen = [weakref.ref(t) for t in groups._partial.get("all", {}).values()]
    assert seen  # "all" was incomplete when the loop stopped
    gc.collect()
    assert all(r() is None for r in seen)


def test_host_slots_are_kept_for_the_next_stream_within_the_cap(model: Path) -> None:
    """A closed stream's staging slots (their pages in, and on a GPU pinned) serve the next stream."""
    host = shared_limits().host
    host.trim(0)
    ring = {"ring_bytes": 1 << 20, "slots": 2, "chunk_bytes": 1 << 16}
    seen: list[set[int]] = []
    for _ in range(2):
        with streamload.iter(model, device="cpu", reader="posix", **ring) as stream:
            next(stream)
            seen.append({s.data_ptr() for s in stream._pipeline.device._ring.slots})  # type: ignore[attr-defined]
            list(stream)
        assert streamload.usage().staging_kept == 1 << 20 and streamload.usage().staging_bytes == 0
    assert len(seen[0]) == 2 and seen[1] == seen[0]  # the same memory, not new allocations
    before = streamload.usage().staging_cap
    try:
        streamload.set_limits(staging_bytes=1 << 19)  # a smaller cap drops what it cannot keep
        assert streamload.usage().staging_kept <= 1 << 19
        streamload.set_limits(staging_bytes=1 << 20)
        with streamload.iter(model, device="cpu", reader="posix", **ring) as stream:
            next(stream)  # holds the whole cap: nothing may stay kept beside it
            assert streamload.usage().staging_bytes + streamload.usage().staging_kept <= 1 << 20
    finally:
        streamload.set_limits(staging_bytes=before)
        host.trim(0)


def test_host_slots_are_pinned_once_and_unpinned_when_dropped() -> None:
    from streamload.base.limits import HostSlots

    host, registered, undone = HostSlots(), [], []

    def register(slot: torch.Tensor):  # type: ignore[no-untyped-def]
        registered.append(slot.data_ptr())
        return lambda: undone.append(slot.data_ptr())

    slot = host.take(1 << 16)
    assert slot.data_ptr() % 4096 == 0  # page-aligned (O_DIRECT and registration want it)
    assert host.pin(slot, register) and host.pin(slot, register) and registered == [slot.data_ptr()]
    host.give([slot], keep=1 << 16)
    assert host.take(1 << 16).data_ptr() == slot.data_ptr() and host.kept == 0
    host.give([slot], keep=0)  # nothing may be kept: dropped, and unpinned first
    assert undone == [slot.data_ptr()] and host.kept == 0
    assert not host.pin(host.take(4096), lambda s: None)  # a refused registration is reported, not raised
