"""Mutated files: either exactly what safetensors loads, or streamload's own error naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import streamload

from .conftest import same_bits

_BASE: bytes | None = None


def base_file() -> bytes:
    global _BASE
    if _BASE is None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            g = torch.Generator().manual_seed(0)
            save_file({"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int16),
                       "c": torch.randn(2, 2, generator=g).to(torch.bfloat16)}, f"{tmp}/x.safetensors",
                      metadata={"k": "v"})  # fmt: skip
            _BASE = Path(f"{tmp}/x.safetensors").read_bytes()
    return _BASE


def check(path: Path) -> None:
    """The contract: same tensors as safetensors, or a StreamloadError naming the file."""
    try:
        ref = load_file(path)
    except Exception:
        ref = None
    try:
        got = streamload.load(path, device="cpu", reader="posix")
    except streamload.StreamloadError as exc:
        assert str(path) in str(exc)
        return
    assert ref is not None, "streamload accepted a file safetensors rejects"
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert same_bits(got[name], t), name


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 64), st.integers(0, 255)),
    st.tuples(st.just("length"), st.sampled_from([0, 1, 7, 2**31, 2**63 - 1, 2**64 - 1, 10**8 + 1]), st.just(0)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_files(tmp_path: Path, mutations: list) -> None:
    data = bytearray(base_file())
    for kind, a, b in mutations:
        if kind == "flip" and data:
            data[a % len(data)] ^= b
        elif kind == "truncate":
            del data[a % (len(data) + 1) :]
        elif kind == "extend":
            data += bytes([b]) * a
        elif kind == "length" and len(data) >= 8:
            data[:8] = a.to_bytes(8, "little")
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(data))
    check(path)


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entry=st.fixed_dictionaries(
        {},
        optional={
            "dtype": st.sampled_from(["F32", "I8", "BOOL", "F4", "XX"]) | json_value,
            "shape": st.lists(st.integers(-2, 2**64), max_size=3) | json_value,
            "data_offsets": st.lists(st.integers(-1, 2**65), min_size=0, max_size=3) | json_value,
        },
    ),
    metadata=json_value,
    data_len=st.integers(0, 64),
)
def test_generated_headers(tmp_path: Path, entry: dict, metadata: object, data_len: int) -> None:
    header = {"t": entry, "__metadata__": metadata}
    raw = json.dumps(header).encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\x01" * data_len)
    check(path)


@pytest.mark.parametrize("depth", [10, 1000, 100_000])
def test_deep_nesting(tmp_path: Path, depth: int) -> None:
    raw = b"{" + b'"a":{' * depth + b"}" * depth + b"}"
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    check(path)
