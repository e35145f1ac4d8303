"""The CUDA path. GPU tests skip where no CUDA device is present; the routing tests run everywhere."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.read.kvikio import KvikioReader

from .conftest import random_tensor, same_bits

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SMALL_RING = {"ring_bytes": 256 * 1024, "slots": 2, "chunk_bytes": 32 * 1024}


def _kvikio_works() -> bool:
    try:
        KvikioReader(4, 1 << 20).close()
    except streamload.UnsupportedError:
        return False
    return torch.cuda.is_available()


READERS = ["posix", pytest.param("kvikio", marks=pytest.mark.skipif(not _kvikio_works(), reason="no kvikio"))]
DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64,
]  # fmt: skip


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(streamload.UnsupportedError, match="no CUDA device"):
        streamload.iter(tmp_path, device="cuda")


def test_reader_choice_is_checked(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(streamload.UnsupportedError, match="kvikio"):
        streamload.iter(tmp_path, device="cpu", reader="kvikio")
    with pytest.raises(ValueError, match="reader"):
        streamload.iter(tmp_path, device="cpu", reader="fast")  # type: ignore[arg-type]
    with pytest.raises(streamload.UnsupportedError, match="not supported"):
        streamload.iter(tmp_path, device="meta")


def test_kvikio_import_failure_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)  # `import kvikio` now raises ImportError
    with pytest.raises(streamload.UnsupportedError, match="kvikio cannot be imported"):
        KvikioReader(4, 1 << 20)


@pytest.fixture
def every_dtype(tmp_path: Path) -> Path:
    tensors = {f"t.{str(d).removeprefix('torch.')}": random_tensor(d, (33, 7), seed=i) for i, d in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    tensors["big"] = random_tensor(torch.bfloat16, (700, 257), seed=99)  # spans several small slots
    save_file(tensors, tmp_path / "all.safetensors")
    return tmp_path / "all.safetensors"


@cuda
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("tuning", [{}, SMALL_RING], ids=["default", "small-ring"])
def test_bit_exact_every_dtype_on_gpu(every_dtype: Path, reader: str, tuning: dict) -> None:
    ref = load_file(every_dtype)
    with streamload.iter(every_dtype, device="cuda", reader=reader, **tuning) as stream:
        got = dict(stream)
    assert stream.stats.reader.startswith(reader) and stream.stats.device.startswith("cuda")
    for name, t in ref.items():
        assert got[name].is_cuda and same_bits(got[name].cpu(), t), name


@cuda
@pytest.mark.parametrize("reader", READERS)
def test_conversion_on_gpu(every_dtype: Path, reader: str) -> None:
    # The reference is torch's conversion on the same device: CUDA canonicalises NaN payloads where
    # the CPU keeps them, so a CPU conversion differs from any GPU conversion in NaNs' bits.
    ref = load_file(every_dtype)
    got = streamload.load(every_dtype, device="cuda", reader=reader, dtype=torch.float16, **SMALL_RING)
    for name, t in ref.items():
        floating = t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        expected = t.cuda().to(torch.float16) if floating else t
        assert same_bits(got[name].cpu(), expected.cpu()), name


@cuda
@pytest.mark.parametrize("reader", READERS)
def test_owned_after_many_wraps_and_multi_file(tmp_path: Path, reader: str) -> None:
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.w": torch.randn(256, 256, generator=g) for i in range(40)}
    save_torch_state_dict(state, tmp_path, max_shard_size=2_000_000)
    kept = list(streamload.iter(tmp_path, device="cuda", reader=reader, ring_bytes=512 * 1024, slots=2))
    assert len(kept) == 40  # 10 MB through a 512 KiB ring: it wrapped ~20 times
    for name, t in kept:
        assert torch.equal(t.cpu(), state[name]), name


@cuda
@pytest.mark.parametrize("reader", READERS)
def test_consumer_stream_sees_data_without_synchronize(every_dtype: Path, reader: str) -> None:
    ref = load_file(every_dtype)
    side = torch.cuda.Stream()
    sums = {}
    with torch.cuda.stream(side):  # read each tensor on another stream the moment it arrives
        for name, t in streamload.iter(every_dtype, device="cuda", reader=reader, **SMALL_RING):
            sums[name] = t.view(-1).view(torch.uint8).to(torch.int64).sum() if t.numel() else None
    side.synchronize()
    for name, t in ref.items():
        if t.numel():
            assert sums[name].item() == t.reshape(-1).view(torch.uint8).to(torch.int64).sum().item(), name


@cuda
@pytest.mark.parametrize("reader", READERS)
def test_early_exit_frees_the_ring(every_dtype: Path, reader: str) -> None:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kept = []
    with streamload.iter(every_dtype, device="cuda", reader=reader, ring_bytes=64 << 20) as stream:
        for _name, t in stream:
            kept.append(t)
            if len(kept) == 3:
                break
    gc.collect()
    torch.cuda.synchronize()
    held = sum(t.untyped_storage().nbytes() for t in kept)
    # What is left is the kept tensors (rounded up by the allocator to 512-byte blocks), not the ring.
    assert torch.cuda.memory_allocated() - before <= held + 512 * len(kept)


@cuda
def test_auto_falls_back_when_kvikio_is_missing(
    every_dtype: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        stream = streamload.iter(every_dtype, device="cuda")
    assert stream.stats.reader == "posix"
    assert "kvikio is unavailable" in caplog.text
    ref = load_file(every_dtype)
    assert all(same_bits(t.cpu(), ref[n]) for n, t in stream)


@cuda
@pytest.mark.parametrize("reader", READERS)
def test_load_into_in_place_on_cuda(tmp_path: Path, reader: str) -> None:
    """Weights reloaded into a CUDA module: addresses unchanged, values exact, converted to each
    parameter's dtype on the loader's stream, tied weights tied; queued work on the destination first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 300))
    model[2].weight = model[0].weight
    model = model.to("cuda:0", torch.bfloat16)
    model[1].float()  # mixed dtypes
    state = {
        k: random_tensor(torch.float32, tuple(v.shape), seed=i) for i, (k, v) in enumerate(model.state_dict().items())
    }
    state.pop("2.weight")
    save_file(state, tmp_path / "m.safetensors")
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time, so that the next kernel is still queued
    model[1].weight.mul_(2)  # queued on the current stream: must not land after the reload's writes
    streamload.load_into(model, tmp_path / "m.safetensors", in_place=True, reader=reader, **SMALL_RING)
    torch.cuda.synchronize()
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert model[2].weight is model[0].weight
    for name, t in state.items():
        got = model.state_dict()[name]
        assert torch.equal(got.cpu(), t.to(got.dtype)), name


@cuda
def test_staging_slots_are_really_pinned_and_a_refused_registration_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamload.base.limits import shared_limits

    state = {f"w{i}": random_tensor(torch.float16, (256, 256), seed=i) for i in range(4)}
    save_file(state, tmp_path / "m.safetensors")
    got: dict[str, torch.Tensor] = {}
    slots: list[torch.Tensor] = []
    with streamload.iter(tmp_path / "m.safetensors", device="cuda:0", reader="posix", **SMALL_RING) as stream:
        for name, t in stream:
            got[name] = t
            slots = slots or list(stream._pipeline.device._ring.slots)  # type: ignore[attr-defined]
    assert slots and all(s.is_pinned() for s in slots)  # registered with CUDA, as torch sees it
    assert all(same_bits(got[n].cpu(), t) for n, t in state.items())
    shared_limits().host.trim(0)

    real = torch.cuda.cudart()

    class Refusing:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            return int(real.cudaHostRegister(ptr, 1 << 62, flags))  # a size CUDA refuses: a real CUDA error

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    got = streamload.load(
        tmp_path / "m.safetensors", device="cuda:0", reader="posix", dtype=torch.float32, **SMALL_RING
    )
    assert all(torch.equal(got[n].cpu(), t.float()) for n, t in state.items())  # the dtype copy (a kernel) ran
    torch.ones(4, device="cuda:0").add_(1)  # and so does the caller's next kernel
    torch.cuda.synchronize()
    shared_limits().host.trim(0)


@cuda
def test_repeated_loads_do_not_grow_reserved_memory(tmp_path: Path) -> None:
    """Every load allocates on the device's one loader stream, so freed blocks are reused by the next
    load instead of staying reserved for a stream nobody uses again."""
    state = {f"w{i}": random_tensor(torch.bfloat16, (512, 512), seed=i) for i in range(8)}
    save_file(state, tmp_path / "m.safetensors")
    reserved = []
    for _ in range(12):
        got = streamload.load(tmp_path / "m.safetensors", device="cuda:0", reader="posix", dtype=torch.float32)
        del got
        gc.collect()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] <= reserved[1], reserved


@cuda
def test_async_face_on_cuda(tmp_path: Path) -> None:
    import anyio

    state = {f"w{i}": random_tensor(torch.float16, (128, 64), seed=i) for i in range(5)}
    save_file(state, tmp_path / "m.safetensors")

    async def main() -> dict[str, torch.Tensor]:
        got = {}
        async with streamload.iter(tmp_path / "m.safetensors", device="cuda:0", **SMALL_RING) as stream:
            async for name, t in stream:
                got[name] = t
        return got

    got = anyio.run(main)
    assert all(same_bits(got[n].cpu(), t) for n, t in state.items())


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_means_the_current_device(tmp_path: Path) -> None:
    save_file({"w": torch.arange(6.0)}, tmp_path / "m.safetensors")
    with torch.cuda.device(1):
        got = streamload.load(tmp_path / "m.safetensors", device="cuda")
    assert got["w"].device == torch.device("cuda", 1)
