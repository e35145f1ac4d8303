from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def write_raw(
    path: Path,
    entries: dict[str, tuple[str, list[int], bytes]],
    metadata: dict[str, str] | None = None,
    pad: bytes = b"",
) -> Path:
    """A safetensors file written by hand (for dtypes safetensors' Python API lacks, and bad headers)."""
    header: dict[str, object] = {}
    data = b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    write_header(path, json.dumps(header).encode() + pad, data)
    return path


def write_header(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    n = len(header) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + header + data)
    return path


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(-1).view(torch.uint8).numpy()
    )


def in_torch_layout(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every parameter and buffer copied into torch's own (64-byte-aligned) allocations.

    A reference loaded by transformers or diffusers may keep some weights as views of the file's
    mapping, at the file's 8-byte alignment; CPU kernels sum in another order on such operands (a
    one-row linear, on this machine below 16 bytes), so its outputs depend on the file's layout.
    streamload places a model's weights as torch would: compare against the reference so placed."""
    for m in module.modules():
        for _name, p in m._parameters.items():
            if p is not None:
                p.data = p.data.clone()
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.clone()
    return module


def assert_torch_layout(module: torch.nn.Module) -> None:
    unaligned = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.data_ptr() % 64]
    assert not unaligned, f"not 64-byte aligned: {unaligned[:5]}"


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


# Idle threads that the async libraries keep cached for later work are theirs, not ours.
_CACHED = ("AnyIO worker thread", "Trio thread")


def own_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.name.startswith(_CACHED)}
