"""Readers: they fill bytes (into staging slots, or into the page tables of a file mapping)."""

from streamload.read.base import Job, Reader, Work
from streamload.read.mmap import MmapReader
from streamload.read.posix import DirectReader, PosixReader

__all__ = ["DirectReader", "Job", "MmapReader", "PosixReader", "Reader", "Work"]
