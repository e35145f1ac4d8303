"""Tensor-parallel sharding: each rank gets `tensor_split(full, world, dim)[rank]` and reads only its bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import streamload
from streamload import ShardSpec

from .conftest import random_tensor, same_bits

RULES = {
    "*.q_proj.weight": 0,  # column parallel
    "*.up_proj.weight": 0,
    "*.o_proj.weight": 1,  # row parallel
    "*.down_proj.weight": 1,
    "*embed_tokens*": 0,  # vocab
    "*.conv": 2,
}
DIMS = {"q_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1, "embed_tokens": 0, "conv": 2}


def dim_of(name: str) -> int | None:
    return next((d for k, d in DIMS.items() if k in name), None)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp")
    state = {"model.embed_tokens.weight": random_tensor(torch.bfloat16, (101, 24), seed=1)}
    for i in range(3):  # uneven sizes: 37, 53 and 5 do not divide by 2, 3 or 4
        p = f"model.layers.{i}."
        state |= {p + "q_proj.weight": random_tensor(torch.float32, (37, 24), seed=10 + i),
                  p + "o_proj.weight": random_tensor(torch.float16, (24, 37), seed=20 + i),
                  p + "up_proj.weight": random_tensor(torch.bfloat16, (53, 24), seed=30 + i),
                  p + "down_proj.weight": random_tensor(torch.bfloat16, (24, 53), seed=40 + i),
                  p + "norm.weight": random_tensor(torch.float32, (24,), seed=50 + i),
                  p + "conv": random_tensor(torch.float32, (3, 4, 5), seed=60 + i)}  # fmt: skip
    save_file(state, path / "model.safetensors")
    return path


def expected(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    return {n: t if (d := dim_of(n)) is None else torch.tensor_split(t, world, d)[rank] for n, t in full.items()}


@pytest.fixture(params=["strided", "whole"])
def strided_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a later-dim split is read: the rank's blocks only, or whole tensors then sliced."""
    monkeypatch.setattr(streamload.plan, "MIN_STRIDED_READ", 0 if request.param == "strided" else 1 << 30)
    return request.param


@pytest.mark.parametrize("reader", ["mmap", "posix"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_gets_its_exact_slice(model: Path, reader: str, world: int, strided_reads: str) -> None:
    full = load_file(model / "model.safetensors")
    for rank in range(world):
        got = streamload.load(model, device="cpu", reader=reader, shard=ShardSpec(RULES, rank, world),
                              ring_bytes=8192, slots=2, chunk_bytes=4096)  # fmt: skip
        for name, want in expected(full, rank, world).items():
            assert got[name].is_contiguous() and same_bits(got[name], want), (name, rank)


def test_callable_rules_conversion_and_skip(model: Path) -> None:
    full = load_file(model / "model.safetensors")

    def rules(name: str, shape: tuple[int, ...]) -> int | str | None:
        if ".layers.1." in name:
            return ShardSpec.SKIP  # e.g. experts this rank does not own
        return 0 if len(shape) == 2 and shape[0] % 2 == 0 else None

    got = streamload.load(model, device="cpu", shard=ShardSpec(rules, 1, 2), dtype=torch.float32)
    assert not any(".layers.1." in n for n in got)
    for name, t in got.items():
        d = 0 if t.dim() == 2 and full[name].shape[0] % 2 == 0 else None
        want = full[name] if d is None else torch.tensor_split(full[name], 2, d)[1]
        assert same_bits(t, want.float() if want.is_floating_point() else want), name


def test_bytes_read_are_the_ranks_share(model: Path, strided_reads: str) -> None:
    infos = streamload.inspect(model).tensors
    # Read whole, a later-dim split costs every rank the whole tensor (cheaper than scattered reads
    # when its blocks are small); read strided, each rank reads only its own blocks.
    split_dims = (0, 1, 2) if strided_reads == "strided" else (0,)
    split = sum(t.nbytes for n, t in infos.items() if dim_of(n) in split_dims)
    replicated = sum(t.nbytes for n, t in infos.items() if dim_of(n) not in split_dims)
    for world in (2, 4):
        reads = []
        for rank in range(world):
            with streamload.iter(model, device="cpu", reader="posix", shard=ShardSpec(RULES, rank, world)) as s:
                for _ in s:
                    pass
            reads.append(s.stats.bytes_read)
        assert sum(reads) == split + world * replicated  # every split byte read once, by one rank
        for r in reads:
            assert abs(r - (split / world + replicated)) <= split * 0.1


def test_bad_specs_are_clear(model: Path) -> None:
    with pytest.raises(ValueError, match="rank and world_size"):
        streamload.iter(model, shard=ShardSpec(RULES))
    with pytest.raises(ValueError, match="rank 2"):
        streamload.iter(model, shard=ShardSpec(RULES, 2, 2))
    with pytest.raises(ValueError, match="dimension 5"):
        streamload.iter(model, shard=ShardSpec({"*": 5}, 0, 2))


def _rank_main(rank: int, world: int, model: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        with streamload.iter(model, device="cpu", shard=ShardSpec(RULES)) as stream:  # rank, world from dist
            got = dict(stream)
        full = load_file(os.path.join(model, "model.safetensors"))
        ok = all(same_bits(got[n], t) for n, t in expected(full, rank, world).items())
        Path(out, f"rank{rank}.json").write_text(json.dumps({"ok": ok, "bytes_read": stream.stats.bytes_read}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_torch_distributed_gloo(model: Path, tmp_path: Path, world: int) -> None:
    mp.start_processes(_rank_main, args=(world, str(model), str(tmp_path)), nprocs=world, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["ok"] for r in results)
    assert len({r["bytes_read"] for r in results}) > 1 or world == 1  # uneven splits: ranks read different amounts
