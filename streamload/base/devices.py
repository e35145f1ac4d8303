"""Torch devices as callers name them: which one a `device=` argument means (`resolve`) and whether two
are one (`same`). Below plan, the readers and the devices, which all ask (device/ re-exports both)."""

from __future__ import annotations

import torch

from streamload.base.errors import UnsupportedError


def resolve(device: str | torch.device | None) -> torch.device:
    """The device a `device=` argument means, with "cuda" resolved here, in the caller's thread, to
    `cuda:{current_device()}` (worker threads, as offload's fetches and the async face, see device 0
    as current, not the caller's); None: cuda where available, else cpu.

    >>> resolve("cpu")
    device(type='cpu')
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's own message lists every backend it was built with
        raise UnsupportedError(
            f"device {device!r} is not a device torch knows: use 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def same(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one ("cuda" is the current CUDA device).

    >>> same(torch.device("cpu"), torch.device("cpu"))
    True
    """
    if a.type != b.type:
        return False
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
