"""What a checkpoint's quantization is, from its config's `quantization_config` and its tensors' names
and dtypes: the method, the weights' bits, the group or block size, and which tensors are scales."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from streamload.plan.checkpoint import Checkpoint
from streamload.quant.methods import METHODS, SCALES, WEIGHTS, quantized_name


class Quantization(NamedTuple):
    method: str  # the config's quant_method, or what the tensors show ("float8 weights")
    bits: int | None  # of a weight value
    group: str | None  # "per channel", "groups of 128", "blocks of 128x128", ...
    scales: int  # tensors that are scales, zero points or indices
    scale_names: tuple[str, ...]  # their name patterns ("*.weight_scale_inv")
    weights: int  # quantized weight tensors
    weight_dtypes: tuple[str, ...]  # as stored

    def line(self) -> str:
        """One line for `streamload inspect`."""
        what = [f"{self.bits}-bit" if self.bits else None, self.group]
        head = ", ".join(w for w in what if w)
        stored = "/".join(self.weight_dtypes) or "no weight"
        names = ", ".join(self.scale_names) or "none"
        method = f"{self.method} ({head})" if head else self.method
        weights = f"{self.weights} quantized weights stored as {stored}"
        return f"quantization: {method}; {weights}; {self.scales} scale tensors: {names}"


def describe(checkpoint: Checkpoint, config: dict[str, Any] | None = None) -> Quantization | None:
    """The checkpoint's quantization, or None for plain weights. `config`: its `config.json` (by default
    read beside a local checkpoint's files)."""
    if config is None:
        config = _config_beside(checkpoint)
    declared = config.get("quantization_config") if isinstance(config, dict) else None
    declared = declared if isinstance(declared, dict) else None
    tensors = checkpoint.tensors.values()
    names = checkpoint.tensors.keys()
    scales = [t for t in tensors if t.name.endswith(SCALES) and quantized_name(t.name, names)]
    weights = [
        t
        for t in tensors
        if (t.name.endswith(WEIGHTS) and quantized_name(t.name, names)) or _scaled_float(t.dtype.name)
    ]
    if declared is None and not scales and not weights:
        return None
    method, bits, group = _declared(declared) if declared else (None, None, None)
    if method is None:
        method = "float8 weights" if any(_scaled_float(t.dtype.name) for t in weights) else "unnamed (no config)"
    if bits is None and any(t.dtype.name.startswith("F8_") for t in weights):
        bits = 8  # packed integers do not tell their bits (an I32 holds eight 4-bit values, or four 8-bit)
    patterns = sorted({"*" + next(e for e in SCALES if t.name.endswith(e)) for t in scales})
    return Quantization(method=method, bits=bits, group=group, scales=len(scales), scale_names=tuple(patterns),
                        weights=len(weights), weight_dtypes=tuple(sorted({t.dtype.name for t in weights})))  # fmt: skip


def _config_beside(checkpoint: Checkpoint) -> dict[str, Any] | None:
    if not checkpoint.files or not isinstance(checkpoint.files[0].path, Path):
        return None  # an object store's: its config is not fetched for this
    path = checkpoint.files[0].path.parent / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # no config, or not one: the tensors still tell


def _declared(config: dict[str, Any]) -> tuple[str | None, int | None, str | None]:
    """(method, bits, group) as the quantization_config states them (each format's own keys)."""
    method = config.get("quant_method")
    bits = config.get("bits") or config.get("w_bit")
    group: str | None = None
    if block := config.get("weight_block_size"):
        group = "blocks of " + "x".join(map(str, block))
    elif (size := config.get("group_size") or config.get("q_group_size")) not in (None, -1):
        group = f"groups of {size}"
    for scheme in (config.get("config_groups") or {}).values():  # compressed-tensors
        weights = scheme.get("weights") if isinstance(scheme, dict) else None
        if isinstance(weights, dict):
            bits = bits or weights.get("num_bits")
            strategy = weights.get("strategy")
            if strategy == "group":
                group = f"groups of {weights.get('group_size')}"
            elif strategy == "block":
                group = "blocks of " + "x".join(map(str, weights.get("block_structure") or ()))
            elif strategy:
                group = f"per {strategy}"
            kind = weights.get("type")
            method = " ".join(w for w in (method, config.get("format"), kind) if w)
            break
    if (known := METHODS.get(method) if isinstance(method, str) else None) is not None:  # what its config leaves unsaid
        bits, group = bits or known.bits, group or known.group
    return (str(method) if method else None), (int(bits) if bits else None), group


def _scaled_float(dtype_name: str) -> bool:
    return dtype_name.startswith(("F8_", "F4", "F6"))
