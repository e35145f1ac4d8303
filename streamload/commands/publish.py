"""A trainer's side of weight updates: each step written as a checkpoint servers can stream, atomically.

`publish(tensors, root, step)` writes `root/step-<step>/`: safetensors shards, their index, and the
digest file `streamload digest` writes (`verify=` checks it), all under a temporary name in `root`,
flushed, then renamed in one step. A server watching `root` sees a step whole or not at all, never a
half-written one, and a step, once there, never changes (publishing it again is an error).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from streamload.format.dtypes import DTYPES
from streamload.read.base import writable_bytes
from streamload.storage import INDEX_NAME

_NAMES = {d.torch_dtype: name for name, d in DTYPES.items() if d.torch_dtype is not None and d.packed == 1}
SHARD_BYTES = 5 << 30  # as transformers' save_pretrained shards


def publish(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root: str | os.PathLike[str],
    step: int | str,
    *,
    shard_bytes: int = SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `tensors` as the checkpoint `root/step-<step>/` (shards of up to `shard_bytes`, an index,
    a digest file), atomically; returns its path. Tensors on a GPU are copied to host memory one at a
    time (a trainer's whole state is never held twice)."""
    root = Path(root)
    final = root / f"step-{step}"
    if final.exists():
        raise FileExistsError(f"{final}: step {step} is published already (a step never changes)")
    pairs = _checked(tensors)  # before anything is written: a bad entry named, no folder left behind
    root.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".step-{step}.", suffix=".partial", dir=root))  # unique: two writers
    try:
        shards = _shards(pairs, shard_bytes)
        weight_map: dict[str, str] = {}
        for k, shard in enumerate(shards):
            name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_file(temporary / name, shard, dict(metadata or {}))
            weight_map.update(dict.fromkeys((n for n, _ in shard), name))
        total = sum(t.numel() * t.element_size() for _, t in pairs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (temporary / INDEX_NAME).write_text(json.dumps(index, indent=1))
        from streamload.pipeline.verify import write_digests
        from streamload.plan.checkpoint import open_checkpoint

        write_digests(open_checkpoint(temporary))
        for path in [*temporary.iterdir(), temporary]:
            _fsync(path)
        os.rename(temporary, final)  # one step: a reader sees the whole step or none of it
        _fsync(root)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return final


def _checked(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, each name text and each value a tensor of a dtype safetensors can name."""
    if isinstance(tensors, (str, bytes, torch.Tensor)) or not isinstance(tensors, (Mapping, Iterable)):
        raise TypeError(f"tensors must be a mapping of names to tensors, not {type(tensors).__name__}")
    pairs = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"tensors must be a mapping or (name, tensor) pairs, not an entry {pair!r:.80}")
        name, t = pair
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be text, not {type(name).__name__} {name!r:.80}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r}: must be a torch.Tensor, not {type(t).__name__} {t!r:.80}")
        if t.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
    return pairs


def _shards(pairs: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def _write_file(path: Path, pairs: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """One safetensors file: its header (offsets, 8-byte aligned), then each tensor's bytes in order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, t in pairs:
            host = t.detach().to("cpu").contiguous()
            if host.numel():
                f.write(writable_bytes(host.view(-1)))


def _fsync(path: Path) -> None:
    """A file's bytes, or a folder's names, on disk before the step is renamed into view."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
