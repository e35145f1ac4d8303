"""Readers: they fill bytes (into staging slots, or into the page tables of a file mapping)."""

from .base import Job, Reader, Work
from .mmap import MmapReader
from .posix import DirectReader, PosixReader

__all__ = ["DirectReader", "Job", "MmapReader", "PosixReader", "Reader", "Work"]
