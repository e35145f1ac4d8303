"""Defaults from the machine: reader threads, request size and ring size from what the process sees.

The rule (measurements behind it in docs/benchmarks.md):

- reader threads: 2 per CPU the process may run on, at least 8, at most 32. A read waits on storage or
  on page faults far more than it computes, so more threads than cores keep more requests in flight
  (an H100 machine with 16 cores: 8 threads 0.88 s, 16 threads 0.62 s, 32 threads 0.54 s for 8 GB).
- request size: 32 MiB into a GPU (there: 8 MiB 0.62 s, 32 MiB 0.43 s warm; 5.0 s against 4.1 s cold);
  8 MiB on the CPU, where mapping is bound by page faults and a 64 MiB slot in 8 MiB requests keeps 8
  threads on the first batch, not 2 (a 2-core VM, 2.1 GB cold: first tensor 84 ms against 192-221 ms
  with 32 MiB); never so large that fewer requests than threads would cover the checkpoint, so a
  small checkpoint is still read by every thread; never under 1 MiB.
- ring: into a GPU, 8 slots in up to 1 GiB (there: 256 MiB / 4 slots 0.62 s, 1 GiB / 8 slots 0.39 s),
  at most an eighth of the memory available and no larger than the checkpoint; on the CPU, 4 slots
  of 64 MiB (the posix reader's ring; the mapping reader's slots hold no memory), or of 16 MiB where
  the load copies its bytes into tensors of its own (`into=`: a mixture of experts converted into
  fused parameters, a reload), read through the ring, not mapped, so the checkpoint is never in the
  process twice (measured on a 1.23 GB MoE: peak 1.09x its bytes, against 2.03x mapped, and faster).

Every value can be given instead (`streamload.iter(..., threads=, chunk_bytes=, ring_bytes=, slots=)`);
`streamload bench PATH --sweep` measures a grid around these on your own storage.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

MiB = 1 << 20
GiB = 1 << 30


class Tuning(NamedTuple):
    """How much memory and how many threads a stream uses (`base/tuning.py` derives them from the machine)."""

    ring_bytes: int  # all staging slots together
    slots: int  # ring slots: reads of up to `slots` batches are in flight
    threads: int  # reader threads
    chunk_bytes: int  # the most one read request asks for

    @property
    def slot_bytes(self) -> int:
        return self.ring_bytes // self.slots // 64 * 64

    def check(self) -> None:  # (slots and threads: checked as options, at least 1)
        if self.slot_bytes < 4096:
            raise ValueError(
                f"ring of {self.ring_bytes} bytes in {self.slots} slots gives slots under 4 KiB; "
                "make the ring larger or the slots fewer"
            )
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, not {self.chunk_bytes}")


class Staging(NamedTuple):
    """A device kind's defaults for staging (device/kinds.py gives each kind one): the figures above."""

    chunk_bytes: int  # the largest read request
    slots: int
    ring_from_memory: bool  # the ring sized by the load and the memory available, else a fixed host ring


HOST_STAGING = Staging(8 * MiB, 4, False)  # into host memory: mapping and page faults bound the reads
DEVICE_STAGING = Staging(32 * MiB, 8, True)  # into device memory: every byte crosses a bus after its read


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of host memory available without swapping (MemAvailable), None where unknown."""
    with contextlib.suppress(OSError), open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def reader_threads() -> int:
    return min(32, max(8, 2 * cpu_count()))


def tuning(
    staging: Staging,
    total_bytes: int,
    *,
    ring_bytes: int | None = None,
    slots: int | None = None,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    copies: bool = False,
) -> Tuning:
    """The tuning for a load of `total_bytes` with a device kind's `staging` defaults (its `.staging`);
    given values win. `copies`: most bytes are copied into tensors that exist already (`into=`)."""
    threads, slots = threads or reader_threads(), slots or staging.slots
    if chunk_bytes is None:  # the power of two at or below each thread's share
        chunk_bytes = min(staging.chunk_bytes, 1 << (max(MiB, total_bytes // threads).bit_length() - 1))
    if ring_bytes is None:
        if staging.ring_from_memory:
            memory = available_memory()
            ring_bytes = min(GiB, memory // 8 if memory else GiB, max(total_bytes, slots * MiB))
            ring_bytes = max(ring_bytes, slots * 4096)
        else:
            ring_bytes = 64 * MiB if copies else 256 * MiB
    return Tuning(ring_bytes, slots, threads, chunk_bytes)
