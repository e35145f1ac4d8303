"""Header validation: every way a header can break the format gives a clear error naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import streamload
from streamload.format.header import HEADER_LIMIT
from streamload.storage.local import LocalStorage

from .conftest import write_header, write_raw

read_header = LocalStorage().header


def entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": offsets or [0, 8]}


def header(**tensors: object) -> bytes:
    return json.dumps(tensors).encode()


BAD: dict[str, tuple[bytes, bytes, str]] = {
    # name: (header bytes, data, text the message must contain)
    "not utf-8": (b'{"a": "\xff\xfe"}', b"", "UTF-8"),
    "not json": (b"{not json", b"", "JSON"),
    "not an object": (b"[1, 2]", b"", "not a JSON object"),
    "unknown dtype": (header(w=entry("F7")), b"\0" * 8, "F7"),
    "dtype not a string": (header(w=entry(3)), b"\0" * 8, "unknown dtype"),
    "shape negative": (header(w=entry(shape=[-2])), b"\0" * 8, "shape"),
    "shape not ints": (header(w=entry(shape=[2.0])), b"\0" * 8, "shape"),
    "shape bool": (header(w=entry(shape=[True])), b"\0" * 8, "shape"),
    "shape not list": (header(w=entry(shape=2)), b"\0" * 8, "shape"),
    "offsets one int": (header(w={"dtype": "F32", "shape": [2], "data_offsets": [0]}), b"\0" * 8, "data_offsets"),
    "offsets not ints": (header(w=entry(offsets=[0, "8"])), b"\0" * 8, "data_offsets"),
    "offsets reversed": (header(w=entry(offsets=[8, 0])), b"\0" * 8, "after end"),
    "missing shape": (header(w={"dtype": "F32", "data_offsets": [0, 8]}), b"\0" * 8, "missing 'shape'"),
    "entry not object": (header(w=[1]), b"", "must be an object"),
    "size mismatch": (header(w=entry(shape=[3])), b"\0" * 8, "takes 12 bytes"),
    "overflowing shape": (header(w=entry(shape=[2**62, 2**62])), b"\0" * 8, "takes"),
    "overlap": (header(a=entry(), b=entry(offsets=[4, 12])), b"\0" * 12, "overlaps"),
    "hole": (header(a=entry(), b=entry(offsets=[12, 20])), b"\0" * 20, "hole"),
    "not from zero": (header(a=entry(offsets=[4, 12])), b"\0" * 12, "hole"),
    "data past eof": (header(a=entry(offsets=[0, 8])), b"\0" * 4, "data section holds only 4"),
    "bytes left over": (header(a=entry()), b"\0" * 9, "left over"),
    "metadata not map": (header(__metadata__=[1]), b"", "__metadata__"),
    "metadata values": (header(__metadata__={"a": 1}), b"", "__metadata__"),
    "duplicate name": (
        b'{"a": ' + json.dumps(entry()).encode() + b', "a": ' + json.dumps(entry()).encode() + b"}",
        b"\0" * 8,
        "twice",
    ),
    "packed bits": (header(w={"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}), b"\0", "whole bytes"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, b"", "JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_header(tmp_path: Path, case: str) -> None:
    raw, data, needle = BAD[case]
    path = write_header(tmp_path / "bad.safetensors", raw, data)
    with pytest.raises(streamload.HeaderError) as info:
        streamload.iter(path)
    assert isinstance(info.value, ValueError) and isinstance(info.value, streamload.StreamloadError)
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_tensor_named_in_message(tmp_path: Path) -> None:
    path = write_header(tmp_path / "bad.safetensors", header(my_weight=entry("X9")), b"\0" * 8)
    with pytest.raises(streamload.HeaderError, match="my_weight"):
        read_header(path)


@pytest.mark.parametrize(
    ("prefix", "needle"),
    [
        (b"", "too short"),
        (b"\x01\x00", "too short"),
        ((HEADER_LIMIT + 1).to_bytes(8, "little"), "over the format's limit"),
        ((50).to_bytes(8, "little") + b"{}", "past the end"),
        ((2**64 - 1).to_bytes(8, "little"), "over the format's limit"),
        (b"import torch\nprint(torch.__version__)\n", "not a safetensors file: .* the file starts b'import torch"),
        ((10).to_bytes(8, "little") + b"[1, 2, 3] ", "not a safetensors file"),
    ],
)
def test_bad_length_word(tmp_path: Path, prefix: bytes, needle: str) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(prefix)
    with pytest.raises(streamload.HeaderError, match=needle) as info:
        streamload.inspect(path)
    assert str(path) in str(info.value)


def test_truncated_file_names_the_first_tensor_missing_bytes(tmp_path: Path) -> None:
    raw = header(a=entry(offsets=[0, 8]), b=entry(offsets=[8, 16]), c=entry(offsets=[16, 24]))
    path = write_header(tmp_path / "cut.safetensors", raw, b"\0" * 12)
    with pytest.raises(streamload.HeaderError, match=r"truncated: tensor 'b' .* 12 \(12 bytes missing in all\)"):
        read_header(path)


def test_whitespace_padding_is_legal(tmp_path: Path) -> None:
    raw = b"  \n" + header(w=entry()) + b" " * 13
    path = write_header(tmp_path / "pad.safetensors", raw, b"\1" * 8)
    h = read_header(path)
    assert [t.name for t in h.tensors] == ["w"]
    assert h.data_start == 8 + len(raw)
    assert streamload.load(path, device="cpu")["w"].view(-1).view(dtype=__import__("torch").uint8).tolist() == [1] * 8


def test_header_larger_than_first_read(tmp_path: Path) -> None:
    meta = {f"key{i}": "x" * 100 for i in range(5000)}  # ~600 KB header, more than one pread
    path = write_raw(tmp_path / "big.safetensors", {"w": ("U8", [3], b"abc")}, metadata=meta)
    assert streamload.inspect(path).metadata == meta
    assert bytes(streamload.load(path, device="cpu")["w"].numpy()) == b"abc"


def test_empty_checkpoint_and_zero_size_tensors(tmp_path: Path) -> None:
    empty = write_header(tmp_path / "empty.safetensors", b"{}")
    assert streamload.load(empty, device="cpu") == {}
    path = write_raw(
        tmp_path / "z.safetensors", {"a": ("F32", [0, 3], b""), "b": ("F16", [], b"\0<"), "c": ("I8", [0], b"")}
    )
    out = streamload.load(path, device="cpu")
    assert out["a"].shape == (0, 3) and out["c"].shape == (0,)
    assert out["b"].shape == () and out["b"].item() == 1.0


def test_fifo_is_refused_not_read(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(streamload.SourceError, match="not a regular file"):
        streamload.inspect(fifo)


def test_tensor_count_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = {f"t{i}": ("U8", [1], bytes([i])) for i in range(6)}
    path = write_raw(tmp_path / "many.safetensors", entries)
    monkeypatch.setattr(streamload.format.header, "TENSOR_LIMIT", 5)
    with pytest.raises(streamload.HeaderError, match=r"many\.safetensors: header lists 6 tensors, more than the limit"):
        read_header(path)
    monkeypatch.setattr(streamload.format.header, "TENSOR_LIMIT", 6)
    assert len(read_header(path).tensors) == 6
