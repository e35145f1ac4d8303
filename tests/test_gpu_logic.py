"""The logic of the CUDA paths that runs without a GPU: kvikio's setup and probe falling back, with
kvikio and the reader replaced by stand-ins that fail the way the real ones do."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload import UnsupportedError
from streamload.base.tuning import Tuning
from streamload.pipeline import reader_choice as routes
from streamload.read import kvikio as kvikio_reader


class FakeDefaults:
    def __init__(self) -> None:
        self.values = {"num_threads": 1, "task_size": 4 << 20}
        self.sets: list[dict[str, int]] = []

    def get(self, key: str) -> int:
        return self.values[key]

    def set(self, changes: dict[str, int]) -> None:
        self.sets.append(changes)
        self.values.update(changes)

    def is_compat_mode_preferred(self) -> bool:
        return False  # GDS, as a machine with cuFile reports it


@pytest.fixture
def fake_kvikio(monkeypatch: pytest.MonkeyPatch) -> FakeDefaults:
    defaults = FakeDefaults()
    module = types.ModuleType("kvikio")
    module.defaults = defaults  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)  # type: ignore[arg-type]
    return defaults


def test_settings_are_set_only_when_they_change(fake_kvikio: FakeDefaults) -> None:
    kvikio_reader.KvikioReader(8, 4 << 20)
    kvikio_reader.KvikioReader(8, 4 << 20)
    kvikio_reader.KvikioReader(8, 16 << 20)
    # a new thread count rebuilds kvikio's pool: once, and never for an unchanged value
    assert fake_kvikio.sets == [{"num_threads": 8}, {"task_size": 16 << 20}]


def test_a_kvikio_without_defaults_get_is_unsupported(fake_kvikio: FakeDefaults, monkeypatch: Any) -> None:
    monkeypatch.delattr(FakeDefaults, "get")  # kvikio < 25.04
    with pytest.raises(UnsupportedError, match=r"kvikio cannot be set up \(AttributeError.*kvikio >= 25.04"):
        kvikio_reader.KvikioReader(8, 4 << 20)


class ProbeFails:
    """A kvikio reader on a machine where cuFile reports GDS but cannot read the file (tmpfs)."""

    gds = True
    closed = 0

    def __init__(self, threads: int, task_size: int) -> None:
        pass

    def probe(self, path: Path, device: torch.device) -> None:
        raise UnsupportedError(f"kvikio cannot read {path}: cuFile: file system not supported")

    def close(self) -> None:
        ProbeFails.closed += 1


def _load(chosen: bool) -> routes.Load:
    return routes.Load(
        torch.device("cuda", 0), Tuning(1 << 20, 2, 4, 1 << 20), Path("/dev/shm/m.safetensors"), 1, chosen
    )


def test_auto_falls_back_when_the_kvikio_probe_fails(monkeypatch: Any, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kvikio_reader, "KvikioReader", ProbeFails)
    ProbeFails.closed = 0
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert routes._kvikio(_load(chosen=False)) is None  # the next row (posix) serves the load
    assert ProbeFails.closed == 1
    assert "file system not supported; reading with preadv into pinned memory instead" in caplog.text
    with pytest.raises(UnsupportedError, match="file system not supported"):
        routes._kvikio(_load(chosen=True))  # named by the caller: its error
    assert ProbeFails.closed == 2


class FakeCudart:
    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", size, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", 0, 0))
        return 0


def test_a_refused_registration_clears_cudas_error_and_is_not_retried(monkeypatch: Any) -> None:
    from streamload.base.limits import HostSlots
    from streamload.device import cuda

    cudart = FakeCudart(register_error=1)  # cudaErrorInvalidValue, as for memory CUDA cannot lock
    cleared: list[bool] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(cuda, "clear_cuda_error", lambda: cleared.append(True))
    slots = HostSlots()
    slot = slots.take(1 << 16)
    for _ in range(3):  # three batches through the same slot
        assert slots.pin(slot, cuda._register, 1000) is False
    assert cudart.calls == [("register", 4096, 1)] and cleared == [True]  # once; portable; the error cleared


def test_only_the_bytes_used_are_registered_and_a_dropped_slot_is_forgotten(monkeypatch: Any) -> None:
    from streamload.base.limits import HostSlots
    from streamload.device import cuda

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slots = HostSlots()
    slot = slots.take(1 << 16)
    assert slots.pin(slot, cuda._register, 5000)  # two pages
    assert slots.pin(slot, cuda._register, 8000)  # still inside them
    assert slots.pin(slot, cuda._register, 9000)  # more: the whole slot, once
    assert slots.pin(slot, cuda._register, 1 << 16)
    assert cudart.calls == [("register", 8192, 1), ("unregister", 0, 0), ("register", 1 << 16, 1)]
    slots.give([slot], keep=0)  # dropped: unregistered before its memory goes back
    assert cudart.calls[-1] == ("unregister", 0, 0)
    again = slots.take(1 << 16)  # a new slot, maybe at the same address: not taken as registered
    assert slots.pin(again, cuda._register, 100)
    assert cudart.calls[-1] == ("register", 4096, 1)


def test_cuda_is_resolved_to_the_callers_current_device(monkeypatch: Any) -> None:
    """Resolved in the caller's thread: a worker thread (offload's fetches) sees device 0 as current."""
    from streamload.device import resolve as _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # as after torch.cuda.set_device(1)
    assert _device("cuda") == torch.device("cuda", 1)
    assert _device(None) == torch.device("cuda", 1)
    assert _device("cuda:0") == torch.device("cuda", 0)
    assert _device("cpu") == torch.device("cpu")


def test_a_slot_dropped_without_being_given_back_is_unregistered(monkeypatch: Any) -> None:
    import gc

    from streamload.base.limits import HostSlots
    from streamload.device import cuda

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slots = HostSlots()
    slot = slots.take(1 << 14)
    assert slots.pin(slot, cuda._register, 100)
    del slot  # lost, e.g. a stream whose close failed half-way
    gc.collect()
    assert cudart.calls == [("register", 4096, 1), ("unregister", 0, 0)]


def test_the_device_gives_its_slots_back_when_closing_the_files_fails(tmp_path: Path, monkeypatch: Any) -> None:
    from safetensors.torch import save_file

    import streamload
    from streamload.device.cpu import StagedCPU
    from streamload.storage.local import LocalFiles

    save_file({"w": torch.zeros(4)}, str(tmp_path / "m.safetensors"))
    closed: list[bool] = []
    close = StagedCPU.close
    monkeypatch.setattr(StagedCPU, "close", lambda self: (closed.append(True), close(self)))

    def fail(self: Any) -> None:
        raise OSError("close failed")

    monkeypatch.setattr(LocalFiles, "close", fail)
    with pytest.raises(OSError, match="close failed"):
        streamload.load(tmp_path / "m.safetensors", device="cpu", reader="posix")
    assert closed == [True]


class NeverDone:
    """A collective whose peers never answer (a rank that failed or hangs)."""

    waited = False

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self.waited = True  # as gloo's own timeout ends the wait
        raise RuntimeError("Timed out waiting for send operation to complete")


class Aborts:
    def __init__(self) -> None:
        self.calls = 0

    def abort(self) -> None:
        self.calls += 1


@pytest.fixture
def exchange(monkeypatch: pytest.MonkeyPatch) -> Any:
    """An Exchange on a world of one (gloo, in this process) whose collectives never complete."""
    from datetime import timedelta

    import torch.distributed as dist

    from streamload.cooperative import group
    from streamload.cooperative.shares import Exchange

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ex = Exchange(None, torch.device("cpu"))
        assert ex.timeout == dist.default_pg_timeout  # the group's own timeout, read from its backend
        ex.timeout = timedelta(seconds=0.2)
        never = NeverDone()
        monkeypatch.setattr(group, "all_gather", lambda *args: never)
        ex.never = never
        yield ex
    finally:
        dist.destroy_process_group()


def test_a_collective_past_its_deadline_is_an_error_naming_the_tensors_and_aborts_nccl(
    exchange: Any, tmp_path: Path
) -> None:
    import time

    from safetensors.torch import save_file

    import streamload
    from streamload.plan.plan import make_plan
    from tests.conftest import random_tensor

    save_file({"layers.0.w": random_tensor(torch.float32, (64, 64))}, tmp_path / "model.safetensors")
    plan = make_plan(streamload.inspect(tmp_path), slot_bytes=1 << 20)
    batch = plan.batches[0]._replace(shared=True)
    slot = torch.empty(batch.extent + 1, dtype=torch.uint8)

    exchange._pg = Aborts()  # gloo: its own timeout frees its thread, the exchange does not abort
    started = time.monotonic()
    with pytest.raises(streamload.StreamloadError) as caught:
        exchange.gather(batch, slot)
    assert 0.1 < time.monotonic() - started < 5  # 80% of the 0.2 s timeout, not forever
    message = str(caught.value)
    assert "model.safetensors" in message and "'layers.0.w'" in message and "rank 0 of 1" in message
    assert "did not answer within 0.16 s" in message and "aborted" not in message
    assert exchange._pg.calls == 0 and exchange.never.waited  # gloo's thread was done with the slot first

    exchange.on_device = True  # NCCL: a collective that only an abort of the communicators ends
    assert "aborted" not in str(exchange._failed(batch, RuntimeError("NCCL error")))  # nothing aborted yet
    with pytest.raises(TimeoutError):
        exchange._collective(slot, slot)
    assert exchange._pg.calls == 1
    assert "the process group was aborted" in str(exchange._failed(batch, TimeoutError()))


def test_a_failed_collective_raises_the_backends_error() -> None:
    from streamload.cooperative.group import wait

    class Failed:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("NCCL error: remote process exited")

    aborts = Aborts()
    with pytest.raises(RuntimeError, match="remote process exited"):
        wait(Failed(), deadline=float("inf"), abort=aborts.abort)
    assert aborts.calls == 0
