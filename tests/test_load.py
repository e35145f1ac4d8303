"""Tensors arrive bit-identical to safetensors.torch.load_file, with every option and both readers."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import streamload
from streamload.plan.checkpoint import open_checkpoint
from streamload.plan.plan import SLOT_ALIGN, make_plan

from .conftest import random_tensor, same_bits, write_raw

READERS = ["mmap", "posix", "direct"]
SMALL_RING = {"ring_bytes": 64 * 1024, "slots": 4, "chunk_bytes": 4096}  # many batches, split tensors

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64,
]  # fmt: skip


@pytest.fixture
def every_dtype(tmp_path: Path) -> Path:
    tensors = {f"t.{str(d).removeprefix('torch.')}": random_tensor(d, (33, 7), seed=i) for i, d in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    tensors["big"] = random_tensor(torch.bfloat16, (300, 257), seed=99)  # larger than a small slot
    path = tmp_path / "all.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "who": "test"})
    return path


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("tuning", [{}, SMALL_RING], ids=["default", "small-ring"])
def test_bit_exact_every_dtype(every_dtype: Path, reader: str, tuning: dict) -> None:
    ref = load_file(every_dtype)
    got = streamload.load(every_dtype, device="cpu", reader=reader, **tuning)
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert same_bits(got[name], t), name
    assert streamload.inspect(every_dtype).metadata == {"format": "pt", "who": "test"}


@pytest.mark.parametrize("reader", READERS)
def test_dtypes_python_safetensors_lacks(tmp_path: Path, reader: str) -> None:
    e8m0 = bytes(range(256))
    fp4 = bytes(range(255, -1, -1)) * 2
    path = write_raw(tmp_path / "x.safetensors", {"scale": ("F8_E8M0", [16, 16], e8m0), "q": ("F4", [8, 128], fp4)})
    got = streamload.load(path, device="cpu", reader=reader)
    assert got["scale"].dtype == torch.float8_e8m0fnu and got["scale"].shape == (16, 16)
    assert bytes(got["scale"].view(torch.uint8).numpy()) == e8m0
    assert got["q"].dtype == torch.float4_e2m1fn_x2 and got["q"].shape == (8, 64)
    assert bytes(got["q"].view(torch.uint8).numpy()) == fp4


def test_unrepresentable_dtype_named(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "f6.safetensors", {"w6": ("F6_E2M3", [4], b"\0\0\0"), "ok": ("U8", [1], b"\1")})
    with pytest.raises(streamload.UnsupportedError, match="w6") as info:
        streamload.iter(path)
    assert str(path) in str(info.value)
    assert streamload.load(path, device="cpu", exclude="w6")["ok"].tolist() == [1]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("tuning", [{}, SMALL_RING], ids=["default", "small-ring"])
def test_dtype_conversion(every_dtype: Path, reader: str, tuning: dict) -> None:
    ref = load_file(every_dtype)
    got = streamload.load(every_dtype, device="cpu", reader=reader, dtype=torch.float16, **tuning)
    for name, t in ref.items():
        floating = t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        want = t.to(torch.float16) if floating else t  # ints, bool, fp8 and complex keep their dtype
        assert same_bits(got[name], want), name


def test_dtype_mapping(every_dtype: Path) -> None:
    got = streamload.load(
        every_dtype, device="cpu", dtype={"big": torch.float32, "t.float64": None, "*": torch.bfloat16}
    )
    assert got["big"].dtype == torch.float32
    assert got["t.float64"].dtype == torch.float64
    assert got["t.float16"].dtype == torch.bfloat16
    assert got["t.int8"].dtype == torch.int8
    # The first rule that matches decides, a plain name's or a pattern's, whatever their kinds.
    got = streamload.load(every_dtype, device="cpu", dtype={"t.*": torch.float16, "t.float64": torch.float32})
    assert got["t.float64"].dtype == torch.float16 and got["big"].dtype != torch.float16


@pytest.mark.parametrize("reader", READERS)
def test_include_exclude_read_only_selected_bytes(every_dtype: Path, reader: str) -> None:
    with streamload.iter(every_dtype, device="cpu", reader=reader, include=["t.*", "big"], exclude="t.int*") as s:
        names = [n for n, _ in s]
    assert sorted(names) == sorted(
        n for n in load_file(every_dtype) if (n.startswith("t.") and not n.startswith("t.int")) or n == "big"
    )
    assert (
        s.stats.bytes_read
        == s.stats.bytes_total
        == sum(t.nbytes for n, t in open_checkpoint(every_dtype).tensors.items() if n in names)
    )
    assert streamload.load(every_dtype, device="cpu", include=lambda n: n == "scalar").keys() == {"scalar"}


def test_layer_and_file_order(tmp_path: Path) -> None:
    # Shard files hold layers out of order; "layer" order crosses files, "file" order follows offsets.
    def t() -> torch.Tensor:
        return torch.zeros(2)

    save_file({"lm_head.weight": t(), "model.layers.1.w": t(), "model.layers.10.w": t()}, tmp_path / "a.safetensors")
    save_file({"model.norm.weight": t(), "model.layers.0.w": t(), "model.embed_tokens.weight": t(),
               "model.layers.2.w": t()}, tmp_path / "b.safetensors")  # fmt: skip
    names = [n for n, _ in streamload.iter(tmp_path, device="cpu")]
    assert names[0] == "model.embed_tokens.weight"
    layers = [n for n in names if ".layers." in n]
    assert layers == ["model.layers.0.w", "model.layers.1.w", "model.layers.2.w", "model.layers.10.w"]
    assert set(names[-2:]) == {"lm_head.weight", "model.norm.weight"}
    by_file = [n for n, _ in streamload.iter(tmp_path, device="cpu", order="file")]
    a = open_checkpoint(tmp_path / "a.safetensors").files[0].tensors
    b = open_checkpoint(tmp_path / "b.safetensors").files[0].tensors
    assert by_file == [x.name for x in a] + [x.name for x in b]


def test_hf_sharded_checkpoint(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    state = {f"model.layers.{i}.{p}": random_tensor(torch.bfloat16, (64, 48), seed=i * 3 + j)
             for i in range(6) for j, p in enumerate(["q", "k", "v"])}  # fmt: skip
    state["model.embed_tokens.weight"] = random_tensor(torch.float32, (100, 16), seed=7)
    save_torch_state_dict(state, tmp_path, max_shard_size=40_000)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "stray.safetensors").write_bytes(b"not named by the index, so never opened")
    got = streamload.load(tmp_path, device="cpu")
    assert got.keys() == state.keys()
    for name, t in state.items():
        assert same_bits(got[name], t)
    assert len(streamload.inspect(tmp_path).files) == len(shards)


@pytest.mark.parametrize("reader", READERS)
def test_kept_tensors_survive_ring_wraparound(tmp_path: Path, reader: str) -> None:
    # 48 x 64 KiB tensors through a 128 KiB ring: the ring wraps ~24 times while we keep everything.
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(128, 128, generator=g) for i in range(48)}
    save_file(state, tmp_path / "m.safetensors")
    kept = []
    with streamload.iter(tmp_path / "m.safetensors", device="cpu", reader=reader, ring_bytes=128 * 1024, slots=2) as s:
        for name, t in s:
            kept.append((name, t))
            t.add_(1)  # owned: writing to it must touch neither the file nor any other tensor
    assert len(kept) == 48
    for name, t in kept:
        assert torch.equal(t, state[name] + 1), name
    assert same_bits(load_file(tmp_path / "m.safetensors")["layers.0.w"], state["layers.0.w"])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(["U8", "F16", "F32", "F64"])), max_size=12),
    slot=st.integers(1, 64).map(lambda k: k * SLOT_ALIGN),
)
def test_plan_covers_every_byte_once(tmp_path_factory: pytest.TempPathFactory, sizes: list, slot: int) -> None:
    width = {"U8": 1, "F16": 2, "F32": 4, "F64": 8}
    entries = {f"t{i}": (d, [n], bytes(n * width[d])) for i, (n, d) in enumerate(sizes)}
    path = write_raw(tmp_path_factory.mktemp("p") / "p.safetensors", entries)
    plan = make_plan(open_checkpoint(path), slot_bytes=slot, dtype=torch.float64)
    seen: dict[str, list[tuple[int, int]]] = {}
    for batch in plan.batches:
        ends = [p.slot_offset + p.length for p in batch.pieces]
        assert max(ends) <= slot and all(p.slot_offset % SLOT_ALIGN == 0 for p in batch.pieces)
        for p in batch.pieces:
            assert p.offset % p.item.stored.itemsize == 0 and p.length % p.item.stored.itemsize == 0
            seen.setdefault(p.item.name, []).append((p.offset, p.length))
    for item in plan.items:
        ranges = seen[item.name]
        assert ranges[0][0] == 0 and sum(n for _, n in ranges) == item.info.nbytes
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
        if item.info.nbytes <= slot:
            assert len(ranges) == 1  # a tensor that fits a slot is never split


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(DTYPES)), min_size=1, max_size=10),
    files=st.integers(1, 3),
    slots=st.integers(1, 5),
    slot_kib=st.integers(4, 24),
    chunk_kib=st.integers(4, 16),
    reader=st.sampled_from(READERS),
    convert=st.booleans(),
)
def test_ring_reuse_random_checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
    shapes: list,
    files: int,
    slots: int,
    slot_kib: int,
    chunk_kib: int,
    reader: str,
    convert: bool,
) -> None:
    """Random tensors over random files through random rings: every byte lands where it belongs."""
    directory = tmp_path_factory.mktemp("ring")
    state = {f"layers.{i % 4}.t{i}": random_tensor(d, (n,), seed=i) for i, (n, d) in enumerate(shapes)}
    names = list(state)
    for k in range(files):
        part = {n: state[n] for n in names[k::files]}
        if part:
            save_file(part, directory / f"s{k}.safetensors")
    dtype = torch.float32 if convert else None
    got = streamload.load(
        directory, device="cpu", reader=reader, dtype=dtype,
        ring_bytes=slots * slot_kib * 1024, slots=slots, chunk_bytes=chunk_kib * 1024,
    )  # fmt: skip
    assert got.keys() == state.keys()
    for name, t in state.items():
        floating = t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        assert same_bits(got[name], t.to(torch.float32) if convert and floating else t), name


def test_dtype_names_are_accepted_and_bad_ones_named(tmp_path: Path) -> None:
    save_file({"a.w": torch.randn(4, 4), "b.i": torch.arange(3)}, tmp_path / "m.safetensors")
    assert streamload.load(tmp_path, device="cpu", dtype="float16")["a.w"].dtype == torch.float16
    got = streamload.load(tmp_path, device="cpu", dtype={"a.*": "torch.bfloat16"})
    assert got["a.w"].dtype == torch.bfloat16 and got["b.i"].dtype == torch.int64
    with pytest.raises(streamload.UnsupportedError, match="dtype='float17' is not a torch dtype"):
        streamload.load(tmp_path, device="cpu", dtype="float17")
    with pytest.raises(streamload.UnsupportedError, match=r"dtype=3: pass a torch dtype"):
        streamload.load(tmp_path, device="cpu", dtype=3)  # type: ignore[arg-type]


def test_filling_something_that_is_not_a_module_is_a_clear_error(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(TypeError, match="load_into fills a torch.nn.Module, not object"):
        streamload.load_into(object(), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offload runs a torch.nn.Module, not dict"):
        streamload.offload({}, tmp_path, budget_bytes=1 << 20)  # type: ignore[arg-type]


def test_the_package_shows_only_its_public_names() -> None:
    import subprocess
    import sys

    names = dir(streamload)
    assert "Any" not in names and "TYPE_CHECKING" not in names and "iter" in names and "IntegrityError" in names
    assert set(streamload.__all__) <= set(names)
    # `import streamload` imports nothing heavy until a name is used
    out = subprocess.run([sys.executable, "-c", "import sys, streamload; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "False"


def test_every_face_verifies(tmp_path: Path) -> None:
    from torch import nn

    from streamload.pipeline.verify import write_digests

    state = {"layers.0.w": torch.randn(8, 8), "layers.1.w": torch.randn(8, 8)}
    save_file(state, tmp_path / "m.safetensors")
    write_digests(streamload.inspect(tmp_path))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Module() for _ in range(2))
            for m in self.layers:
                m.register_parameter("w", nn.Parameter(torch.empty(8, 8)))

    net = Net()
    streamload.load_into(net, tmp_path, device="cpu", verify=True)
    assert torch.equal(net.layers[1].w, state["layers.1.w"])
    assert [k for k, _ in streamload.layers(tmp_path, device="cpu", verify=True)] == ["layers.0", "layers.1"]
    info = streamload.inspect(tmp_path).tensors["layers.1.w"]
    with open(info.path, "r+b") as f:
        f.seek(info.begin)
        f.write(b"\xff\xff")
    fresh = Net()
    with pytest.raises(streamload.IntegrityError, match="'layers.1.w'"):
        streamload.load_into(fresh, tmp_path, device="cpu", verify=True)
    with pytest.raises(streamload.IntegrityError):
        streamload.load(tmp_path, device="cpu", verify=True)


def test_first_batches_grow_from_first_batch_to_a_slot(tmp_path: Path) -> None:
    """A store behind a network hands out its first tensors after their own bytes: batch k holds at
    most first_batch * 2**k bytes (or one tensor that is larger), up to a slot; nothing is split
    that fits a slot."""
    entries = {f"t{i:02d}": ("U8", [100_000], bytes(100_000)) for i in range(40)}
    entries["big"] = ("U8", [700_000], bytes(700_000))
    path = write_raw(tmp_path / "m.safetensors", entries)
    slot = 1 << 20
    plan = make_plan(open_checkpoint(path), slot_bytes=slot, order="file", first_batch=128 << 10)
    sizes = [b.nbytes for b in plan.batches]
    for k, batch in enumerate(plan.batches):
        limit = min(slot, (128 << 10) << k)
        assert batch.nbytes <= limit or len({p.item.name for p in batch.pieces}) == 1
    assert sizes[0] == 100_000 and sizes[1] == 200_000 and sizes[2] == 500_000  # 128 K, 256 K, 512 K
    assert max(sizes) > 900_000  # then whole slots
    assert sum(sizes) == 4_700_000
    flat = make_plan(open_checkpoint(path), slot_bytes=slot, order="file")
    assert flat.batches[0].nbytes > 900_000  # no ramp: the first batch is a slot


def _reader_threads() -> int:
    import threading

    return sum(t.name.startswith("streamload-read") for t in threading.enumerate())


def test_mapped_load_reads_on_threads_only_what_the_page_cache_lacks(tmp_path: Path) -> None:
    import os

    from streamload.read.resident import resident

    tensors = {f"model.layers.{i}.w": random_tensor(torch.bfloat16, (512, 512), seed=i) for i in range(6)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    size = path.stat().st_size
    path.read_bytes()  # every page cached
    fd = os.open(path, os.O_RDONLY)
    try:
        if not resident(fd, 0, size):
            pytest.skip("this kernel has no cachestat (Linux < 6.5): every range is read on threads")
        for cold in (False, True):
            if cold:  # the warm pass's tensors (views of the mapping) are gone: its pages can be dropped
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert not resident(fd, 0, size)
            threads = 0
            stream = streamload.iter(path, reader="mmap", chunk_bytes=64 * 1024)
            got = {}
            for name, t in stream:
                threads = max(threads, _reader_threads())
                got[name] = t
            assert stream.stats.bytes_read == stream.stats.bytes_total  # resident ranges count as read
            assert all(same_bits(got[k], v) for k, v in load_file(path).items())
            # Warm: every range resident, no request handed out, so no thread started; cold: threads read.
            assert (threads > 0) == cold
            del got, stream, t
    finally:
        os.close(fd)
