"""Devices: they turn a slot's bytes into owned tensors and say when a slot may be reused; and which
torch device a caller's `device=` means (`resolve`, `same`: base/devices.py), for every entry point alike."""

from __future__ import annotations

from streamload.base.devices import resolve, same
from streamload.device.base import Delivered, Device
from streamload.device.cpu import MappedCPU, StagedCPU

__all__ = ["Delivered", "Device", "MappedCPU", "StagedCPU", "resolve", "same"]
