"""Progress counters of one stream: live while it runs, final after."""

from __future__ import annotations

import time


class Stats:
    """What a progress bar or a benchmark wants to know about a stream.

    A plain class, not a dataclass: defining one costs ~2.5 ms of `import`, on every load's clock.
    """

    __slots__ = ("bytes_read", "bytes_total", "bytes_verified", "device", "finished", "reader",
                 "staging_bytes", "started", "tensors_done", "tensors_total", "time_to_first_tensor")  # fmt: skip

    def __init__(self, bytes_total: int = 0, tensors_total: int = 0, reader: str = "", device: str = "") -> None:
        self.bytes_total, self.tensors_total, self.reader, self.device = bytes_total, tensors_total, reader, device
        self.bytes_read = 0
        self.tensors_done = 0
        self.time_to_first_tensor: float | None = None
        self.staging_bytes = 0  # staging memory the stream held from the process-wide budget (set at its end)
        self.bytes_verified = 0  # checked against a digest (verify=; set at the stream's end)
        self.started: float | None = None
        self.finished: float | None = None

    @property
    def elapsed(self) -> float:
        """Seconds since the stream started (until it finished, once it has)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started

    @property
    def gbps(self) -> float:
        """Bytes read per second so far, in GB/s (10^9)."""
        return self.bytes_read / self.elapsed / 1e9 if self.elapsed else 0.0

    def __repr__(self) -> str:
        ttft = "-" if self.time_to_first_tensor is None else f"{self.time_to_first_tensor:.4f}"
        return (
            f"Stats(bytes_read={self.bytes_read}/{self.bytes_total}, tensors_done={self.tensors_done}/"
            f"{self.tensors_total}, elapsed={self.elapsed:.4f}, gbps={self.gbps:.2f}, time_to_first_tensor={ttft}, "
            f"reader={self.reader!r}, device={self.device!r}, staging_bytes={self.staging_bytes})"
        )

    def start(self) -> None:
        self.started = time.perf_counter()

    def add_read(self, n: int) -> None:
        self.bytes_read += n

    def delivered(self) -> None:
        self.tensors_done += 1
        if self.time_to_first_tensor is None:
            self.time_to_first_tensor = self.elapsed
        if self.tensors_done == self.tensors_total:
            self.finish()

    def finish(self) -> None:
        if self.finished is None and self.started is not None:
            self.finished = time.perf_counter()
