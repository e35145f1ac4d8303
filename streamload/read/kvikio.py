"""The kvikio reader: file -> device memory through GPUDirect Storage, or kvikio's POSIX mode.

kvikio and its CUDA libraries are imported only when this reader is chosen; any failure to import or
to read raises `UnsupportedError`, which the router turns into a fallback to the posix reader.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import torch

from streamload.base.errors import UnsupportedError
from streamload.plan.plan import Batch
from streamload.read.base import Job, Span, eof_error, read_error, span_groups
from streamload.storage import LocalFiles


class KvikioReader:
    """Reads each span with `CuFile.pread` straight into the device slot; kvikio splits every request
    into `task_size` tasks on its own thread pool of `threads` threads."""

    def __init__(self, threads: int, task_size: int) -> None:
        try:
            import kvikio
            import kvikio.defaults
        except Exception as exc:  # ImportError, or a missing libcufile/libcuda behind it
            raise UnsupportedError(f"kvikio cannot be imported: {exc}") from exc
        self._kvikio: Any = kvikio
        try:  # only the settings that differ: a new `num_threads` rebuilds kvikio's thread pool
            wanted = {"num_threads": threads, "task_size": task_size}
            if changed := {key: value for key, value in wanted.items() if kvikio.defaults.get(key) != value}:
                kvikio.defaults.set(changed)
            self.gds = not kvikio.defaults.is_compat_mode_preferred()
        except Exception as exc:  # kvikio < 25.04 has no defaults.get/set; a broken cuFile setup
            why = f"{type(exc).__name__}: {exc}"
            raise UnsupportedError(f"kvikio cannot be set up ({why}); it needs kvikio >= 25.04") from exc
        self.name = "kvikio-gds" if self.gds else "kvikio-posix"
        self.chunk_bytes = max(task_size, 64 << 20)  # kvikio parallelises inside one request
        self._handles: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def probe(self, path: Path, device: torch.device) -> None:
        """Read a file's first 8 bytes through kvikio and compare: kvikio's first I/O is where a
        missing driver or libcufile shows up."""
        # Uninitialised: a zero-fill would be a kernel on the caller's stream, unordered with kvikio's read.
        buf = torch.empty(8, dtype=torch.uint8, device=device)
        try:
            n = self._handle(path).pread(buf, 8, 0).get()
        except Exception as exc:
            raise UnsupportedError(f"kvikio cannot read {path}: {exc}") from exc
        with open(path, "rb") as f:
            expected = f.read(8)
        if n != 8 or bytes(buf.cpu().tolist()) != expected:
            raise UnsupportedError(f"kvikio read wrong bytes from {path}")

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: LocalFiles) -> list[Job]:
        assert slot is not None and not slot.is_cpu, "the kvikio reader reads into a device slot"
        return [functools.partial(self._read_group, group, slot) for group in span_groups(batch, self.chunk_bytes)]

    def _read_group(self, group: list[Span], slot: torch.Tensor) -> int:
        done = 0
        for span in group:
            file_offset = span.file_offset
            for slot_offset, length in span.parts:
                done += self._read(span.path, slot[slot_offset : slot_offset + length], length, file_offset)
                file_offset += length
        return done

    def _read(self, path: Path, dest: torch.Tensor, length: int, file_offset: int) -> int:
        try:
            n = self._handle(path).pread(dest, length, file_offset).get()
        except Exception as exc:
            raise read_error(path, file_offset, f"kvikio: {exc}") from exc
        if n != length:
            raise eof_error(path, file_offset + n)
        return n

    def _handle(self, path: Path) -> Any:
        with self._lock:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = self._kvikio.CuFile(os.fspath(path), "r")
            return handle

    def close(self) -> None:
        with self._lock:
            handles, self._handles = self._handles, {}
        for h in handles.values():
            h.close()
