"""Cold reads: what the page cache does not hold is read in large requests, or with O_DIRECT."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.commands.bench import evict
from streamload.read import mmap as mmap_reader
from streamload.read import posix
from streamload.read.resident import cached

from .conftest import random_tensor, same_bits


@pytest.fixture
def model(tmp_path: Path) -> Path:
    # Odd sizes: tensors start at offsets that are not block-aligned, as O_DIRECT must cope with.
    tensors = {f"model.layers.{i}.w": random_tensor(torch.bfloat16, (301 + i, 517), seed=i) for i in range(24)}
    save_file(tensors, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


def test_cachestat_tells_cold_from_warm(model: Path) -> None:
    fd = os.open(model, os.O_RDONLY)
    try:
        evict([str(model)])
        assert not cached(fd, 0, model.stat().st_size)
        model.read_bytes()
        assert cached(fd, 0, model.stat().st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("reader", ["posix", "direct"])
def test_cold_ranges_take_the_cold_path_and_load_exactly(
    model: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[bool, int]] = []  # (in the page cache, bytes) of each job
    calls = {"readahead": 0, "direct": 0}
    real_runs, real_spans, real_direct = posix._by_residency, posix._read_spans, posix._read_direct

    def by_residency(files, groups):  # type: ignore[no-untyped-def]
        for warm, group in real_runs(files, groups):
            runs.append((warm, group[-1].end - group[0].file_offset))
            yield warm, group

    def spans(fd, group, slot, readahead=False):  # type: ignore[no-untyped-def]
        calls["readahead"] += readahead
        return real_spans(fd, group, slot, readahead)

    def direct(fd, group, slot):  # type: ignore[no-untyped-def]
        calls["direct"] += 1
        assert os.fstat(fd).st_ino == model.stat().st_ino
        return real_direct(fd, group, slot)

    monkeypatch.setattr(posix, "_by_residency", by_residency)
    monkeypatch.setattr(posix, "_read_spans", spans)
    monkeypatch.setattr(posix, "_read_direct", direct)
    monkeypatch.setattr(posix, "DIRECT_BYTES", 64 * 1024)  # many O_DIRECT requests per run, and partial blocks
    monkeypatch.setattr(posix, "_bounce", __import__("threading").local())
    ref = {n: t.clone() for n, t in load_file(model).items()}  # no mapping left to pin the pages in the cache
    tuning = {"ring_bytes": 1 << 20, "slots": 2, "chunk_bytes": 64 * 1024}
    evict([str(model)])
    got = streamload.load(model, device="cpu", reader=reader, **tuning)
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    cold = [n for warm, n in runs if not warm]  # (the kernel's own readahead may warm some ranges first)
    assert cold and calls["direct" if reader == "direct" else "readahead"] == len(cold)
    assert max(cold) > 64 * 1024  # cold ranges go in requests larger than chunk_bytes
    model.read_bytes()  # all warm now: chunk_bytes requests, nothing cold
    runs.clear()
    calls.update(readahead=0, direct=0)
    got = streamload.load(model, device="cpu", reader=reader, **tuning)
    assert all(same_bits(got[n], ref[n]) for n in ref)
    # Warm ranges go in chunk_bytes requests. (Whether the kernel reports every page cached right after
    # a full read is its business: a range it calls cold rarely is, and takes the cold path, consistently.)
    cold = [n for warm, n in runs if not warm]
    assert all(n <= 64 * 1024 for warm, n in runs if warm) and len(cold) <= len(runs) // 10
    assert calls["direct" if reader == "direct" else "readahead"] == len(cold)


def test_direct_reader_reports_a_truncated_file(model: Path) -> None:
    stream = streamload.iter(model, device="cpu", reader="direct", ring_bytes=1 << 20, slots=2)
    os.truncate(model, model.stat().st_size - 5000)
    evict([str(model)])
    with pytest.raises(streamload.StreamloadError, match=str(model)):
        with stream:
            list(stream)


def test_direct_falls_back_where_o_direct_is_refused(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.storage.local import LocalFiles

    monkeypatch.setattr(LocalFiles, "_open_direct", lambda self, path: None)  # as on tmpfs
    evict([str(model)])
    got = streamload.load(model, device="cpu", reader="direct", ring_bytes=1 << 20, slots=2)
    ref = load_file(model)
    assert all(same_bits(got[n], ref[n]) for n in ref)


def test_scatter_fills_parts_in_order() -> None:
    slot = memoryview(bytearray(16))
    rest = posix._scatter(slot, [(0, 3), (8, 5)], memoryview(b"abcdef"))
    assert bytes(slot[:3]) == b"abc" and bytes(slot[8:11]) == b"def" and rest == [(11, 2)]
    assert posix._scatter(slot, rest, memoryview(b"gh")) == [] and bytes(slot[8:13]) == b"defgh"


@pytest.fixture
def out_of_file_order(tmp_path: Path) -> Path:
    """Two shards whose files store `layers.10` before `layers.2` (names sort as strings), so that layer
    order reads each file out of file order: a read run may hold layer 9 then layer 10."""
    layers = [{f"model.layers.{i}.{w}": random_tensor(torch.float16, (97 + i, 131), seed=10 * i + k)
               for k, w in enumerate(("a.weight", "b.weight"))} for i in range(24)]  # fmt: skip
    index: dict[str, str] = {}
    for shard, span in enumerate((range(0, 12), range(12, 24)), start=1):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {n: t for i in span for n, t in layers[i].items()}
        save_file(tensors, tmp_path / name)
        index.update(dict.fromkeys(tensors, name))
    (tmp_path / "model.safetensors.index.json").write_text(__import__("json").dumps({"weight_map": index}))
    return tmp_path


@pytest.mark.parametrize("order", ["layer", "file"])
@pytest.mark.parametrize(
    "tuning",
    [
        {"ring_bytes": 64 << 20, "slots": 1},  # the whole checkpoint in one batch
        {"ring_bytes": 1 << 20, "slots": 2},
        {"ring_bytes": 256 << 10, "slots": 4, "chunk_bytes": 16 << 10},  # many small requests
    ],
    ids=["one-slot", "1MiB", "small"],
)
@pytest.mark.parametrize("reader", ["posix", "direct", "mmap"])
def test_cold_loads_out_of_file_order_exactly(
    out_of_file_order: Path, reader: str, tuning: dict, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = sorted(str(p) for p in out_of_file_order.glob("*.safetensors"))
    ref = {n: t.clone() for f in files for n, t in load_file(f).items()}
    evict(files)
    # Every range reads as cold, as on kernels before 6.5 (no cachestat): the kernel's readahead of the
    # headers may have brought in these small files already, which would leave the cold path untested.
    monkeypatch.setattr(posix, "cached", lambda fd, offset, length: False)
    monkeypatch.setattr(mmap_reader, "resident", lambda fd, offset, length: False)
    got = streamload.load(out_of_file_order, device="cpu", reader=reader, order=order, **tuning)
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)


def test_an_error_in_a_read_names_the_file(out_of_file_order: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = out_of_file_order / "model-00001-of-00002.safetensors"

    def refuse(*args: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(posix, "cached", lambda fd, offset, length: False)
    monkeypatch.setattr(posix.os, "posix_fadvise", refuse)  # the readahead advice of a cold run fails
    with pytest.raises(streamload.StreamloadError, match=f"{shard}: reading at offset \\d+ failed.*Invalid argument"):
        streamload.load(shard, device="cpu", reader="posix", ring_bytes=1 << 20, slots=2)
    monkeypatch.undo()

    def broken(*args: object) -> int:
        raise ValueError("a reader's bug")

    monkeypatch.setattr(posix, "_read_span", broken)  # an error that names no file: the pipeline names it
    with pytest.raises(streamload.ReadError, match=f"{shard}: reading failed: ValueError: a reader's bug"):
        streamload.load(shard, device="cpu", reader="posix", ring_bytes=1 << 20, slots=2)


def test_extents_bound_a_group_out_of_file_order() -> None:
    from streamload.read.base import Span, extents

    p = Path("m.safetensors")
    group = [
        Span(p, 900, ((0, 100),)),
        Span(p, 100, ((100, 50),)),
        Span(p, 150, ((150, 50),)),
        Span(p, 400, ((200, 8),)),
    ]
    assert extents(group) == [(100, 200), (400, 408), (900, 1000)]


@pytest.mark.parametrize("reader", ["posix", "direct"])
def test_a_read_of_more_tensors_than_one_preadv_takes(tmp_path: Path, reader: str) -> None:
    """3,000 tensors of 6 bytes, contiguous in the file and apart in the slot (each aligned): one span
    of more buffers than a preadv takes (IOV_MAX, 1024 on Linux), read in several calls."""
    tensors = {f"t.{i}": random_tensor(torch.float16, (3,), seed=i) for i in range(3000)}
    save_file(tensors, tmp_path / "m.safetensors")
    got = streamload.load(tmp_path / "m.safetensors", device="cpu", reader=reader, chunk_bytes=8 << 20)
    assert all(same_bits(got[n], t) for n, t in tensors.items())
