"""The device kinds, one a torch device type (`DeviceKind`: device/base.py), registered here once; which
torch device a caller's `device=` means (`resolve`) and whether two are one (`same`), for every entry point.

Callers ask a device's kind (`kind_of`) for what differs between types and never compare a type's name
(tests/test_device_kinds.py holds that). A new type: its module (a kind and a staging device), one row here.
"""

from __future__ import annotations

import torch

from streamload.base.errors import UnsupportedError
from streamload.device.base import DeviceKind
from streamload.device.cpu import CPUKind
from streamload.device.cuda import CudaKind

# The one registration, by torch's device type; accelerators before the host, in the order a load
# without `device=` prefers them.
KINDS: dict[str, DeviceKind] = {kind.type: kind for kind in (CudaKind(), CPUKind())}


def _names() -> str:
    """How a caller names the devices streamload serves, host first: "'cpu', 'cuda' or 'cuda:N'"."""
    names = [name for kind in reversed(KINDS.values()) for name in kind.examples]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def kind_of(device: torch.device | str) -> DeviceKind:
    """The kind of `device`; a type no kind serves is a one-line error naming it."""
    dev = device if isinstance(device, torch.device) else torch.device(device)
    kind = KINDS.get(dev.type)
    if kind is None:
        raise UnsupportedError(f"device {dev} is not supported (use {_names()})")
    return kind


def default_kind() -> DeviceKind:
    """The kind a load without `device=` goes to: the first registered accelerator available, else the host."""
    return next((k for k in KINDS.values() if not k.host_memory and k.available()), kind_of(torch.device("cpu")))


def resolve(device: str | torch.device | None) -> torch.device:
    """The device a `device=` argument means, its index resolved here, in the caller's thread (worker
    threads, as offload's fetches and the async face, see device 0 as current, not the caller's);
    None: `default_kind()`'s."""
    if device is None:
        device = default_kind().type
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's own message lists every backend it was built with
        raise UnsupportedError(f"device {device!r} is not a device torch knows: use {_names()}") from None
    kind = KINDS.get(dev.type)
    return kind.indexed(dev) if kind is not None else dev


def same(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (a device named without an index is its kind's current one)."""
    if a.type != b.type:
        return False
    if a.index is not None and b.index is not None:
        return a.index == b.index
    kind = KINDS.get(a.type)
    current = kind.current_index() if kind is not None else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


__all__ = ["KINDS", "DeviceKind", "default_kind", "kind_of", "resolve", "same"]
