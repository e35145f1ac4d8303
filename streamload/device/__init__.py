"""Devices: they turn a slot's bytes into owned tensors and say when a slot may be reused."""

from .base import Delivered, Device
from .cpu import MappedCPU, StagedCPU

__all__ = ["Delivered", "Device", "MappedCPU", "StagedCPU"]
