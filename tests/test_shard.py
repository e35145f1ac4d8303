"""Tensor-parallel sharding: each rank gets `tensor_split(full, world, dim)[rank]` and reads only its bytes."""

from __future__ import annotations

import itertools
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import streamload
import streamload.plan.plan
from streamload import ShardSpec
from streamload.plan.layer_keys import layer_rank
from streamload.plan.plan import Plan, make_plan

from .conftest import random_tensor, same_bits, start_ranks

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
    monkeypatch.setattr(streamload.plan.plan, "MIN_STRIDED_READ", 0 if request.param == "strided" else 1 << 30)
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


@pytest.mark.parametrize("reader", ["mmap", "posix"])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_full_shape_holds_the_ranks_part_in_place(model: Path, reader: str, dtype: Any, strided_reads: str) -> None:
    full = load_file(model / "model.safetensors")
    spec = ShardSpec(RULES, 1, 3, full_shape=True)
    with streamload.iter(model, device="cpu", reader=reader, shard=spec, dtype=dtype,
                         ring_bytes=8192, slots=2, chunk_bytes=4096) as stream:  # fmt: skip
        got = dict(stream)
    assert stream.stats.bytes_read < sum(t.nbytes for t in full.values())  # still only the part (mostly)
    for name, want in full.items():
        t = got[name]
        assert t.shape == want.shape and t.dtype == (dtype or want.dtype), name
        d = dim_of(name)
        part = t if d is None else torch.tensor_split(t, 3, d)[1]
        ref = want if d is None else torch.tensor_split(want, 3, d)[1]
        if dtype is None:
            assert same_bits(part, ref), name
            if reader == "mmap":  # a view of the file's mapping, not a copy
                assert t.untyped_storage().nbytes() > t.nbytes, name
        else:  # converted: NaN payloads may differ between conversion kernels, values may not
            torch.testing.assert_close(part, ref.to(t.dtype), rtol=0, atol=0, equal_nan=True, msg=name)


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


def test_shard_rules_that_are_not_rules_are_a_type_error_saying_what_rules_are() -> None:
    with pytest.raises(TypeError, match=r"rules must be a mapping of fnmatch patterns .* not str 'lm_head'"):
        ShardSpec("lm_head", rank=0, world_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ShardSpec rule '\*.q_proj.weight': str '0' is not a dimension"):
        ShardSpec({"*.q_proj.weight": "0"}, rank=0, world_size=2)
    with pytest.raises(TypeError, match=r"ShardSpec rule 0: patterns must be text"):
        ShardSpec({0: 0}, rank=0, world_size=2)  # type: ignore[dict-item]
    assert ShardSpec({"a": 0, "b": None, "c": ShardSpec.SKIP, "d": -1}, rank=0, world_size=2).rank == 0


def test_shard_rules_that_match_no_tensor_are_named(tmp_path: Path) -> None:
    import warnings

    save_file({"model.q_proj.weight": torch.arange(8.0).reshape(4, 2), "lm_head.weight": torch.ones(2, 2)},
              tmp_path / "model.safetensors")  # fmt: skip
    typo = ShardSpec({"*.q_proj.weight": 0, "*.qproj.weight": 1, "lm-head*": 0}, rank=1, world_size=2)
    with pytest.warns(UserWarning, match=r"ShardSpec rules '\*.qproj.weight', 'lm-head\*' match none of the "
                      r"checkpoint's 2 tensors"):  # fmt: skip
        got = streamload.load(tmp_path, device="cpu", shard=typo)
    assert torch.equal(got["model.q_proj.weight"], torch.arange(8.0).reshape(4, 2)[2:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streamload.load(tmp_path, device="cpu", shard=ShardSpec({"*.q_proj.weight": 0}, rank=0, world_size=2))


def _rank_main(rank: int, world: int, model: str, out: str, options: dict[str, Any]) -> None:
    """One rank: load its shard with `options`, write what it got (or the error it met) to a file."""
    streamload.plan.plan.MIN_STRIDED_READ = options.pop("min_strided_read", streamload.plan.plan.MIN_STRIDED_READ)
    fail_after = options.pop("fail_after", {}).get(str(rank))  # this rank stops after so many tensors
    options |= options.pop("differ", {}).get(str(rank), {})  # options only this rank uses
    backend = options.pop("backend", "gloo")
    split = options.pop("split", True)  # False: every rank loads the whole checkpoint (replicas)
    options["device"] = options["device"].format(rank=rank)  # "cuda:{rank}": a GPU per rank
    if options["device"].startswith("cuda:"):
        torch.cuda.set_device(torch.device(options["device"]))
    dist.init_process_group(backend, init_method=f"file://{out}/pg", rank=rank, world_size=world,
                            timeout=timedelta(seconds=3))  # fmt: skip
    result: dict[str, Any] = {}
    started = time.monotonic()
    try:
        got: dict[str, torch.Tensor] = {}
        with streamload.iter(model, shard=ShardSpec(RULES) if split else None, **options) as stream:
            for name, t in stream:  # rank and world from torch.distributed
                got[name] = t.cpu()
                if fail_after is not None and len(got) >= fail_after:
                    break
        full = load_file(os.path.join(model, "model.safetensors"))
        kept = streamload.plan.plan.select(full, options.get("include"), options.get("exclude"))
        parts = expected(full, rank, world) if split else full
        want = {n: t for n, t in parts.items() if n in kept and (n in got or fail_after is None)}
        result = {"ok": all(n in got and same_bits(got[n], t) for n, t in want.items()),
                  "bytes_read": stream.stats.bytes_read, "bytes_verified": stream.stats.bytes_verified}  # fmt: skip
        if fail_after is not None:
            time.sleep(5)  # alive but gone from the load: the others must not wait for it forever
    except streamload.StreamloadError as exc:
        result = {"error": str(exc)}
    result["seconds"] = time.monotonic() - started
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_ranks(model: Path, out: Path, world: int, **options: Any) -> list[dict[str, Any]]:
    options.setdefault("device", "cpu")
    start_ranks(_rank_main, (world, str(model), str(out), options), world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_torch_distributed_gloo(model: Path, tmp_path: Path, world: int) -> None:
    results = run_ranks(model, tmp_path, world)
    assert all(r.get("ok") for r in results), results
    assert len({r["bytes_read"] for r in results}) > 1  # uneven splits: ranks read different amounts


@pytest.mark.parametrize(("world", "strided"), [(1, False), (2, True), (3, False), (4, True), (4, False)])
def test_cooperative_reads_each_byte_once(model: Path, tmp_path: Path, world: int, strided: bool) -> None:
    # Tiny slots, so that many shared batches (and tensors cut across slots) are exchanged.
    results = run_ranks(model, tmp_path, world, cooperative=True, ring_bytes=8192, slots=2, chunk_bytes=4096,
                        min_strided_read=0 if strided else 1 << 30)  # fmt: skip
    assert all(r.get("ok") for r in results), results
    # Split bytes are read by their rank only, whole reads are divided among the ranks: together the
    # ranks read the checkpoint's bytes exactly once.
    total = sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    assert sum(r["bytes_read"] for r in results) == total
    assert max(r["bytes_read"] for r in results) < total / world * 1.6


def test_cooperative_loads_verify_every_byte_each_rank_hands_out(model: Path, tmp_path: Path) -> None:
    """verify= with cooperative loading: each rank checks the shared batches once they are whole (its
    peers' parts too) and its own reads as they come; a flipped byte in a replicated tensor, which one
    rank reads for both, is caught on both."""
    import shutil

    from streamload.pipeline.verify import write_digests

    from .test_verify import damage

    folder = tmp_path / "m"
    shutil.copytree(model, folder)
    write_digests(streamload.inspect(folder))
    tiny = {"cooperative": True, "ring_bytes": 8192, "slots": 2, "chunk_bytes": 4096, "verify": True}
    (tmp_path / "ok").mkdir()
    results = run_ranks(folder, tmp_path / "ok", 2, **tiny)
    assert all(r.get("ok") for r in results), results
    total = sum(t.nbytes for t in streamload.inspect(folder).tensors.values())
    assert sum(r["bytes_read"] for r in results) == total  # still each byte read once
    assert all(r["bytes_verified"] >= r["bytes_read"] for r in results)
    assert min(r["bytes_verified"] for r in results) > total / 2  # the shared bytes, checked by each
    norm = streamload.inspect(folder).tensors["model.layers.2.norm.weight"]
    damage(folder / "model.safetensors", norm.begin + norm.nbytes - 2)
    (tmp_path / "bad").mkdir()
    for r in run_ranks(folder, tmp_path / "bad", 2, **tiny):
        assert "'model.layers.2.norm.weight'" in r.get("error", ""), r


def test_cooperative_replicas_each_read_a_share(model: Path, tmp_path: Path) -> None:
    # Data-parallel replicas on shared storage: every rank gets everything, each reads a third.
    results = run_ranks(model, tmp_path, 3, cooperative=True, split=False, ring_bytes=16384, slots=2)
    assert all(r.get("ok") for r in results), results
    total = sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    assert sum(r["bytes_read"] for r in results) == total
    assert all(abs(r["bytes_read"] - total / 3) < total * 0.1 for r in results)


def test_cooperative_ranks_may_select_differently(model: Path, tmp_path: Path) -> None:
    # Rank 1 leaves out the norms: they are no longer read by all, so rank 0 reads them alone.
    results = run_ranks(model, tmp_path, 2, cooperative=True, ring_bytes=16384, slots=2,
                        differ={"1": {"exclude": "*norm*"}})  # fmt: skip
    assert all(r.get("ok") for r in results), results


def test_cooperative_mismatched_calls_are_a_clear_error(model: Path, tmp_path: Path) -> None:
    results = run_ranks(model, tmp_path, 2, cooperative=True, differ={"1": {"ring_bytes": 1 << 20}})
    for r in results:
        assert "ranks [1] load a different checkpoint (or ring layout" in r["error"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_leaving_a_cooperative_load_costs_the_others_only_time(model: Path, tmp_path: Path, world: int) -> None:
    """Rank 1 stops taking part (alive, but gone from the load): once an exchange misses its deadline,
    the others read what it would have shared from storage themselves and end with exact tensors."""
    results = run_ranks(model, tmp_path, world, cooperative=True, ring_bytes=8192, slots=2, chunk_bytes=4096,
                        fail_after={"1": 2}, split=world == 2)  # fmt: skip
    assert all(r.get("ok") for r in results), results  # rank 1: what it took before leaving is right
    for survivor in (r for k, r in enumerate(results) if k != 1):
        assert survivor["seconds"] < 20  # the process group's timeout, not a hang


def test_the_survivors_of_a_lost_rank_read_its_share_once(model: Path, tmp_path: Path) -> None:
    """Four replicas, rank 1 leaves: the three others form a group of their own and read its share a
    third each, so together the ranks still read about the checkpoint once (not once more per survivor)."""
    results = run_ranks(model, tmp_path, 4, cooperative=True, split=False, ring_bytes=8192, slots=2,
                        fail_after={"1": 2})  # fmt: skip
    assert all(r.get("ok") for r in results), results
    total = sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    read = sum(r["bytes_read"] for r in results)
    assert total <= read <= total + 2 * 4096 * 4, read / total  # + what was in flight when it left


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_nccl_world_of_one(model: Path, tmp_path: Path) -> None:
    results = run_ranks(model, tmp_path, 1, device="cuda", backend="nccl", cooperative=True)
    assert results[0].get("ok"), results


@cuda
@pytest.mark.parametrize("world", [2, 4])
def test_cooperative_to_one_gpu_over_gloo(model: Path, tmp_path: Path, world: int) -> None:
    # Several ranks on one GPU: the exchange goes through pinned host slots, then one copy up per slot.
    results = run_ranks(model, tmp_path, world, device="cuda", cooperative=True, ring_bytes=8192, slots=2,
                        chunk_bytes=4096)  # fmt: skip
    assert all(r.get("ok") for r in results), results
    total = sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    assert sum(r["bytes_read"] for r in results) == total


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_rank_leaving_an_nccl_cooperative_load_is_survived_not_the_watchdog(model: Path, tmp_path: Path) -> None:
    # NCCL would spin on the GPU until its watchdog ends the process: the exchange's deadline aborts the
    # group instead, so rank 0 lives on and reads the rest from storage itself.
    results = run_ranks(model, tmp_path, 2, device="cuda:{rank}", backend="nccl", cooperative=True,
                        ring_bytes=8192, slots=2, chunk_bytes=4096, fail_after={"1": 2})  # fmt: skip
    assert results[0].get("ok") and results[1].get("ok"), results  # rank 0 read rank 1's shares itself
    assert results[0]["seconds"] < 20


def test_shared_batches_are_laid_out_alike_on_every_rank(model: Path) -> None:
    ckpt = streamload.inspect(model)
    everywhere = {n for n in ckpt.tensors if "norm" in n or "embed" in n}
    plans = []
    for rank, skip in ((0, ".layers.1."), (1, ".layers.2.")):  # each rank skips other tensors

        def rules(name: str, shape: tuple[int, ...], skip: str = skip) -> int | str | None:
            return ShardSpec.SKIP if skip in name and "norm" not in name else (0 if "q_proj" in name else None)

        plans.append(make_plan(ckpt, slot_bytes=256, shard=ShardSpec(rules, rank, 2),
                               share=lambda items: everywhere & {i.name for i in items}))  # fmt: skip

    def layout(plan: Plan) -> list[list[tuple[str, int, int, int]]]:
        return [[(p.item.name, p.offset, p.length, p.slot_offset) for p in b.pieces] for b in plan.batches if b.shared]

    assert layout(plans[0]) == layout(plans[1]) and layout(plans[0])
    for plan in plans:  # every tensor once, in layer order by first piece, no batch mixes kinds
        assert [b.index for b in plan.batches] == list(range(len(plan.batches)))
        assert all(all((p.item.name in everywhere) == b.shared for p in b.pieces) for b in plan.batches)
        firsts = [layer_rank(b.pieces[0].item.name) for b in plan.batches]
        assert firsts == sorted(firsts)


def test_a_window_of_a_batch_is_its_bytes_in_that_range(model: Path) -> None:
    plan = make_plan(streamload.inspect(model), slot_bytes=4096)
    for batch in plan.batches:
        cuts = sorted({0, batch.extent} | {c for c in (100, 1000, 1001) if c < batch.extent})
        parts = [batch.window(lo, hi) for lo, hi in itertools.pairwise(cuts)]
        covered = [(p.slot_offset, p.file_offset, p.length) for w in parts for p in w.pieces]
        assert sum(n for _, _, n in covered) == batch.nbytes
        for at, file_at, n in covered:  # each byte keeps its place: slot offset -> file offset
            whole = next(p for p in batch.pieces if p.slot_offset <= at < p.slot_offset + p.length)
            assert file_at - whole.file_offset == at - whole.slot_offset and at + n <= whole.slot_offset + whole.length


def test_a_fleet_is_named_by_address_or_by_the_launch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload import Fleet

    assert Fleet("10.0.0.1:29500", world_size=4, rank=2).address == "10.0.0.1:29500"
    for bad in ({"address": "10.0.0.1"}, {"world_size": 0}, {"rank": 4}, {"rank": -1}):
        with pytest.raises(ValueError, match="Fleet"):
            Fleet(**{"address": "h:1", "world_size": 4, "rank": 0, **bad})  # type: ignore[arg-type]
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert Fleet.from_env() is None
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    assert Fleet.from_env() == Fleet("node0:29500", 3, 1)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="launch environment"):
        Fleet.from_env()


def test_cooperative_with_no_group_nor_fleet_says_what_it_needs(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"initialised torch.distributed process group, or a fleet"):
        streamload.load(model, cooperative=True)


def test_a_fleet_of_two_processes_loads_cooperatively(model: Path, tmp_path: Path) -> None:
    """Two processes that share no process group, given only a fleet's address: each reads a share."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import json, sys, torch, streamload\n"
        "from safetensors.torch import load_file\n"
        "fleet = streamload.Fleet(sys.argv[2], world_size=2, rank=int(sys.argv[3]))\n"
        "with streamload.iter(sys.argv[1], cooperative=fleet, ring_bytes=16384, slots=2) as stream:\n"
        "    got = dict(stream)\n"
        "want = load_file(sys.argv[1] + '/model.safetensors')\n"
        "bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)\n"
        "ok = got.keys() == want.keys() and all(bits(got[n]).equal(bits(want[n])) for n in want)\n"
        "print(json.dumps({'ok': ok, 'read': stream.stats.bytes_read}))\n"
    )
    argv = [sys.executable, "-c", code, str(model), f"127.0.0.1:{port}"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen([*argv, str(rank)], **pipes) for rank in range(2)]  # type: ignore[call-overload]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    assert all(r["ok"] for r in results)
    assert sum(r["read"] for r in results) == total  # a share each, not the checkpoint each


def test_a_fleet_address_that_does_not_resolve_fails_at_once_naming_it(model: Path) -> None:
    fleet = streamload.Fleet("nohost.invalid:29511", world_size=2, rank=1)  # waits 5 minutes by default
    started = time.monotonic()
    with pytest.raises(
        streamload.StreamloadError, match=r"fleet at nohost.invalid:29511 as rank 1 of 2: cannot resolve"
    ):
        streamload.load(model, cooperative=fleet)
    assert time.monotonic() - started < 30


def test_a_member_waiting_for_rank_0_says_so_and_gives_up_at_its_timeout(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import socket
    import threading

    from streamload.cooperative import fleet as fleets

    monkeypatch.setattr(fleets, "_SAY_AFTER", 0.5)
    monkeypatch.setattr(fleets, "_SAY_EVERY", 1.0)
    with socket.socket() as s:  # a port nothing listens on (rank 0 never started)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    fleet = streamload.Fleet(address, world_size=2, rank=1, timeout=timedelta(seconds=3))
    threads = threading.active_count()
    started = time.monotonic()
    with pytest.raises(
        streamload.StreamloadError, match=rf"{address} as rank 1 of 2: nothing served the fleet's store"
    ):
        streamload.load(model, cooperative=fleet)
    assert 2.5 < time.monotonic() - started < 15
    said = [r.getMessage() for r in caplog.records if "waiting for rank 0 to serve the fleet's store" in r.getMessage()]
    assert len(said) >= 2 and all(address in line and "of at most 3 s" in line for line in said), said
    assert threading.active_count() == threads  # the thread that said it ended with the wait


def test_cooperative_jobs_under_torchrun_exit_cleanly(model: Path) -> None:
    """A torchrun job as users write one (examples/tensor_parallel.py: the stream kept for its stats,
    then `destroy_process_group` and exit), twice: every rank exits 0, none aborts at exit."""
    import subprocess
    import sys

    example = Path(__file__).parents[1] / "examples" / "tensor_parallel.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(example), str(model), "--cooperative"]  # fmt: skip
    for _ in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "terminate called" not in out, out[-3000:]
        assert out.count("tensors exact") == 2, out[-3000:]


def test_a_closed_cooperative_stream_holds_nothing_of_torch_distributed(model: Path, tmp_path: Path) -> None:
    import gc

    from streamload.cooperative.shares import Exchange

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        exchange = Exchange(None, torch.device("cpu"))
        held = (exchange._pg, exchange.store)
        assert held[0] is not None
        exchange.close()
        assert not [r for r in gc.get_referrers(held[0]) if r is exchange or r is vars(exchange)]
        assert all(v is None for v in (exchange._pg, exchange.store, exchange.backend, exchange.group))
    finally:
        dist.destroy_process_group()
