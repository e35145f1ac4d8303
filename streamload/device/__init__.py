"""Devices: they turn a slot's bytes into owned tensors and say when a slot may be reused; and which
torch device a caller's `device=` means (`resolve`, `same`: torch_device.py), for every entry point alike."""

from __future__ import annotations

from streamload.device.base import Delivered, Device
from streamload.device.cpu import MappedCPU, StagedCPU
from streamload.torch_device import resolve, same

__all__ = ["Delivered", "Device", "MappedCPU", "StagedCPU", "resolve", "same"]
