"""Devices: they turn a slot's bytes into owned tensors and say when a slot may be reused; the device
kinds, which own everything device-specific (`kind_of`: kinds.py); and which torch device a caller's
`device=` means (`resolve`, `same`), for every entry point alike."""

from __future__ import annotations

from streamload.device.base import Delivered, Device, DeviceKind, Into
from streamload.device.cpu import MappedCPU, StagedCPU
from streamload.device.kinds import KINDS, default_kind, kind_of, resolve, same

__all__ = [
    "KINDS", "Delivered", "Device", "DeviceKind", "Into", "MappedCPU", "StagedCPU", "default_kind",
    "kind_of", "resolve", "same",
]  # fmt: skip
