"""transformers' `device_map`, read as the one device streamload loads a model onto: a device, a strategy on a
machine with at most one GPU, or a dict whose entries all name one device and whose keys name the model's
modules."""

from __future__ import annotations

import difflib
from collections.abc import Collection

import torch
from torch import nn

from streamload.device import default_kind, resolve
from streamload.storage.base import redacted

DeviceMap = str | int | torch.device | dict[str, str | int | torch.device] | None
# transformers' device_map strategies: the model spread over the GPUs (on one GPU or none: that device)
_SPREAD = ("auto", "balanced", "balanced_low_0", "sequential")


def check_mapped(path: object, mapped: Collection[str], model: nn.Module, what: str = "") -> None:
    """Each name a device_map placed is a module of the built model ("" the model itself), or a one-line error
    naming it, before any weight is read: a mistyped key would otherwise place nothing and say nothing. `what`:
    the model's name in the message (default: its class)."""
    if not mapped:
        return
    names = {name for name, _ in model.named_modules()}
    key = next((key for key in mapped if key not in names), None)
    if key is not None:
        close = difflib.get_close_matches(key, sorted(names - {""}), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{redacted(path)}: device_map names {key!r}, which is no module of {what or type(model).__name__}{hint}: "
            "its keys are module names ('' for the whole model)"
        )


def one_device(path: object, device: str | torch.device | None, device_map: DeviceMap) -> str | torch.device | None:
    """The one device `device_map` names (as transformers reads it), or `device` where there is none; a map
    that spreads the model over several devices, or offloads it, refused in one line naming it."""
    if device_map is None:
        return device
    where = redacted(path)
    if isinstance(device_map, dict):
        named = {_one(where, device_map, value) for value in device_map.values()}
        if len(named) != 1:
            shown = ", ".join(sorted(str(d) for d in named)) or "no device"
            raise ValueError(
                f"{where}: device_map={device_map!r} places the model on {shown}; streamload.from_pretrained "
                "loads a model onto one device: give device_map={'': device} (or device=), or load a model "
                "spread over devices with transformers' own from_pretrained"
            )
        mapped: torch.device | None = named.pop()
    elif device_map in _SPREAD:
        gpus = default_kind().device_count()  # the accelerator's devices (the host: one)
        if gpus > 1:
            raise ValueError(
                f"{where}: device_map={device_map!r} spreads the model over this machine's {gpus} GPUs; "
                "streamload.from_pretrained loads a model onto one device: give device_map='cuda:N' (or device=)"
            )
        mapped = None  # where streamload loads by default: the GPU, else the CPU
    else:
        mapped = _one(where, device_map, device_map)
    if device is not None and resolve(device) != resolve(mapped):
        raise ValueError(f"{where}: device={device!r} and device_map={device_map!r} name different devices: give one")
    return mapped if device is None else device


def _one(where: str, device_map: DeviceMap, value: object) -> torch.device:
    """One device of a device_map: a device's name, a `torch.device`, or a GPU's index (as accelerate reads it)."""
    if isinstance(value, str) and value in ("disk", *_SPREAD):
        what = "offloads to disk" if value == "disk" else f"names {value!r} for a part of the model"
        raise ValueError(
            f"{where}: device_map={device_map!r} {what}; streamload.from_pretrained loads the whole model onto "
            "one device: give device_map='cpu', 'cuda:N' or {'': device}, or use transformers' own from_pretrained"
        )
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"cuda:{value}"
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{where}: device_map={device_map!r}: {value!r} is not a device")
    return resolve(value)
