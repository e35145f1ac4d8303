"""What the page cache holds: a range's residency, from `cachestat` (Linux >= 6.5).

Readers ask this to treat bytes that have arrived already (warm) apart from bytes storage must still
deliver (cold): cold ranges get readahead and larger requests, or O_DIRECT.
"""

from __future__ import annotations

import ctypes

from streamload.base.page_release import PAGE

_SYS_CACHESTAT = 451  # the same number on every architecture
_SAMPLE_PAGES = 16  # pages looked at in each of three places of a range
try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # not Linux/glibc: everything counts as not cached
    _syscall = None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached(fd: int, offset: int, length: int) -> bool:
    """Whether the range is in the page cache, judged from its start, middle and end: ~12 us whatever
    the range's size, where a whole range's cachestat (`resident`) costs ~7 us per 8 MiB and ~17 us per
    32 MiB when cached. A wrong guess only costs speed, never data."""
    if _syscall is None:
        return False
    first = offset - offset % PAGE
    pages = -(-(offset + length - first) // PAGE)
    window = min(pages, _SAMPLE_PAGES)
    return all(_all_cached(fd, first + at * PAGE, window) for at in {0, (pages - window) // 2, pages - window})


def resident(fd: int, offset: int, length: int) -> bool:
    """Whether every page of the range is in the page cache (one `cachestat` of the whole range)."""
    if _syscall is None or length <= 0:
        return length <= 0
    first = offset - offset % PAGE
    return _all_cached(fd, first, -(-(offset + length - first) // PAGE))


def _all_cached(fd: int, offset: int, pages: int) -> bool:
    stat = _CacheStat()
    rng = _Range(offset, pages * PAGE)
    args = (ctypes.c_long(_SYS_CACHESTAT), ctypes.c_long(fd), ctypes.byref(rng), ctypes.byref(stat), ctypes.c_long(0))
    if _syscall(*args) != 0:  # ENOSYS before Linux 6.5: treat as not cached, populate does the rest
        return False
    return stat.cache >= pages
