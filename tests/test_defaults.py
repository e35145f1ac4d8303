"""The defaults derived from the machine: the rule in base/tuning.py, and that iter() applies it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.base import tuning as defaults

MiB, GiB = 1 << 20, 1 << 30
HOST, DEVICE = defaults.HOST_STAGING, defaults.DEVICE_STAGING  # the CPU's and CUDA's kinds' (test_device_kinds.py)


@pytest.mark.parametrize(("cpus", "threads"), [(1, 8), (2, 8), (6, 12), (16, 32), (128, 32)])
def test_reader_threads_follow_the_cpus(monkeypatch: pytest.MonkeyPatch, cpus: int, threads: int) -> None:
    monkeypatch.setattr(defaults, "cpu_count", lambda: cpus)
    assert defaults.tuning(HOST, 10 * GiB).threads == threads


def test_requests_and_ring_by_device_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "cpu_count", lambda: 16)
    monkeypatch.setattr(defaults, "available_memory", lambda: 128 * GiB)
    gpu = defaults.tuning(DEVICE, 8 * GiB)
    assert (gpu.threads, gpu.chunk_bytes, gpu.ring_bytes, gpu.slots) == (32, 32 * MiB, GiB, 8)
    cpu = defaults.tuning(HOST, 8 * GiB)
    assert (cpu.chunk_bytes, cpu.ring_bytes, cpu.slots) == (8 * MiB, 256 * MiB, 4)
    small = defaults.tuning(DEVICE, 100 * MiB)  # every thread still gets a request; the ring no larger than the load
    assert small.chunk_bytes == 2 * MiB and small.ring_bytes == 100 * MiB
    assert defaults.tuning(DEVICE, 1000).chunk_bytes == MiB
    monkeypatch.setattr(defaults, "available_memory", lambda: 2 * GiB)  # a small host: an eighth of what is free
    assert defaults.tuning(DEVICE, 8 * GiB).ring_bytes == 256 * MiB
    given = defaults.tuning(DEVICE, 8 * GiB, ring_bytes=64 * MiB, slots=2, threads=3, chunk_bytes=MiB)
    assert given == defaults.Tuning(64 * MiB, 2, 3, MiB)


def test_cpu_count_is_the_affinity() -> None:
    import os

    assert defaults.cpu_count() == len(os.sched_getaffinity(0))
    memory = defaults.available_memory()
    assert memory is None or 0 < memory < 1 << 50


def test_iter_applies_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file({"w": torch.ones(1024, 1024)}, tmp_path / "m.safetensors")  # 4 MiB
    monkeypatch.setattr(defaults, "cpu_count", lambda: 2)
    stream = streamload.iter(tmp_path, device="cpu", reader="posix")
    assert stream._pipeline.tuning == defaults.Tuning(256 * MiB, 4, 8, MiB)  # 4 MiB / 8 threads: 512 KiB -> 1 MiB
    stream.close()
    stream = streamload.iter(tmp_path, device="cpu", threads=3, chunk_bytes=64 * 1024)
    assert stream._pipeline.tuning.threads == 3 and stream._pipeline.tuning.chunk_bytes == 64 * 1024
    stream.close()
