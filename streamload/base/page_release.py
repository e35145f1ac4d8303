"""Pages of a private file mapping given back (`Release`): the pages stay in the page cache, the process
no longer holds them. Below the readers, the devices and the model loads, which all give pages back
or map them (`PAGE`, `madvise`: libc's, None off Linux/glibc)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    madvise = _libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc: readers fall back to touching pages, nothing is given back
    madvise = None

_MADV_DONTNEED = 4


class Release:
    """Takes back from the process the pages of tensors the caller has used up (copied out, or quantized
    parts once computed), where they view a private file mapping (read/mmap.py's): the pages stay in
    the page cache, the process no longer holds them, so a load into a model holds about a layer's
    file pages, not the checkpoint's. A page goes once every byte of it was released: tensors given
    back side by side make runs, and the page two of them share goes with the second, while one a
    tensor still in use shares stays (a page of such a mapping that comes back is the file's: nothing
    is lost even where it was read again). Anything else is left alone. One load's: thread-safe."""

    def __init__(self) -> None:
        self._file_backed: dict[int, bool] = {}  # a storage's first byte -> whether a private file mapping holds it
        self._runs: dict[int, int] = {}  # released runs of bytes, both ways: start -> end, end -> start
        self._lock = threading.Lock()

    def __call__(self, t: torch.Tensor) -> None:
        if madvise is None or not t.is_cpu or not t.is_contiguous():  # only host memory maps files
            return
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base % PAGE:  # a mapping starts on a page; the heap's allocations mostly do not
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        with self._lock:
            if base not in self._file_backed:  # a few storages a load (a file each): /proc read once each
                self._file_backed[base] = _private_file_mapping(base)
            if not self._file_backed[base] or end <= start:
                return
            if self._runs.get(start, 0) >= end:
                return  # given back already (twice is once)
            low = self._runs.pop(-start, start)  # a run ending where this tensor starts
            high = self._runs.pop(end, end)  # a run starting where it ends
            self._runs.pop(low, None)
            self._runs.pop(-high, None)
            self._runs[low], self._runs[-high] = high, low
        # this tensor's pages, and the ones it shares with the runs it joined, if now wholly released
        first = max(-(-low // PAGE), start // PAGE) * PAGE
        last = min(high // PAGE, -(-end // PAGE)) * PAGE
        if last > first:
            madvise(first, last - first, _MADV_DONTNEED)


def _private_file_mapping(address: int) -> bool:
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:  # "start-end perms offset dev inode path"
            span, perms, _, _, inode, *_ = line.split()
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms.endswith("p") and inode != "0"
    return False
