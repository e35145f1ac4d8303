"""verify=: digests checked as the bytes are read (per-tensor blocks from a digest file, whole-file
SHA-256 from a Hugging Face cache's blob names or the caller), on real files damaged on purpose."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
import streamload.pipeline.verify
from streamload import IntegrityError, ShardSpec
from streamload.pipeline.verify import BLOCK_BYTES, DIGEST_FILE, write_digests

from .conftest import own_threads, random_tensor, same_bits

SMALL_RING = {"ring_bytes": 1 << 20, "slots": 2}  # tensors larger than a slot: cut across batches


def make_model(folder: Path) -> Path:
    """Two shards; tensors of 2.5 blocks (so blocks straddle slots), small ones, an empty one."""
    folder.mkdir(parents=True, exist_ok=True)
    big = (BLOCK_BYTES * 5 // 2) // 4
    state = {f"model.layers.{i}.mlp.weight": random_tensor(torch.float32, (big // 640, 640), seed=i) for i in range(4)}
    state |= {f"model.layers.{i}.norm.weight": random_tensor(torch.bfloat16, (640,), seed=10 + i) for i in range(4)}
    state["model.embed.weight"] = random_tensor(torch.float16, (300, 64), seed=20)
    state["model.empty"] = torch.zeros(0)
    names = sorted(state)
    save_file({n: state[n] for n in names[:5]}, folder / "model-00001-of-00002.safetensors")
    save_file({n: state[n] for n in names[5:]}, folder / "model-00002-of-00002.safetensors")
    return folder


def reference(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= {n: t.clone() for n, t in load_file(f).items()}  # copies: the files are damaged later
    return out


def damage(path: Path, offset: int) -> None:
    """Flip one byte in place: same size, same header."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def hub_cache(folder: Path, cache: Path) -> Path:
    """The layout of a Hugging Face cache: snapshot files are links to blobs named by their SHA-256."""
    snapshot = cache / "snapshots" / "abc123"
    (cache / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in folder.glob("*.safetensors"):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        os.replace(f, cache / "blobs" / sha)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", sha))
    return snapshot


@pytest.mark.parametrize("reader", ["mmap", "posix"])
@pytest.mark.parametrize("ring", [{}, SMALL_RING])
def test_a_digest_file_verifies_every_byte_and_the_tensors_are_exact(tmp_path: Path, reader: str, ring: dict) -> None:
    model = make_model(tmp_path / "m")
    written, doc = write_digests(streamload.inspect(model))
    assert written == model / DIGEST_FILE
    for f in model.glob("*.safetensors"):
        assert doc["files"][f.name]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    with streamload.iter(model, device="cpu", reader=reader, verify=True, **ring) as stream:
        got = dict(stream)
    ref = reference(model)
    assert set(got) == set(ref) and all(same_bits(got[n], t) for n, t in ref.items())
    assert stream.stats.bytes_verified == sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    first = next(n for n, _ in streamload.iter(model, device="cpu", verify=True))
    assert first.startswith("model.embed")  # layer order


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_a_damaged_tensor_is_never_handed_out(tmp_path: Path, reader: str) -> None:
    model = make_model(tmp_path / "m")
    write_digests(streamload.inspect(model))
    ckpt = streamload.inspect(model)
    before = reference(model)
    victim = ckpt.tensors["model.layers.2.mlp.weight"]
    damage(Path(victim.path), victim.begin + BLOCK_BYTES + 17)  # inside its second block

    handed: list[str] = []
    with pytest.raises(IntegrityError) as caught:
        with streamload.iter(model, device="cpu", reader=reader, verify=True, **SMALL_RING) as stream:
            for name, _ in stream:
                handed.append(name)
    message = str(caught.value)
    assert str(victim.path) in message and "'model.layers.2.mlp.weight'" in message
    assert f"bytes {BLOCK_BYTES}..{2 * BLOCK_BYTES}" in message and "block 2 of 3" in message
    assert "model.layers.1.mlp.weight" in handed and victim.name not in handed  # layer order: 0, 1, then 2 fails
    with pytest.raises(IntegrityError):
        streamload.load(model, device="cpu", reader=reader, verify=True)
    # without verification the damage goes unseen: the damaged bytes are handed out
    assert not same_bits(streamload.load(model, device="cpu", reader=reader)[victim.name], before[victim.name])


def test_hub_cache_blob_names_verify_whole_files_in_file_order(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    ref = reference(model)
    snapshot = hub_cache(model, tmp_path / "models--org--name")
    weight_map = {t.name: t.path.name for t in streamload.inspect(snapshot).tensors.values()}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))  # as the hub has
    with streamload.iter(snapshot, device="cpu", verify=True, **SMALL_RING) as stream:
        names = [n for n, _ in stream]
    ckpt = streamload.inspect(snapshot)
    assert names == [t.name for f in ckpt.files for t in f.tensors]  # file order, not layer order
    assert stream.stats.bytes_verified == sum(f.size for f in ckpt.files)
    assert all(same_bits(t, ref[n]) for n, t in streamload.load(snapshot, device="cpu", verify=True).items())

    shown = {
        f.path.name: d for f, d in zip(ckpt.files, streamload.pipeline.verify.known_digests(ckpt).values(), strict=True)
    }
    assert all(d.whole is not None and d.whole.algorithm == "sha256" for d in shown.values())

    second = ckpt.files[1]
    damage(Path(second.path), second.size - 3)  # the last tensor's bytes
    with pytest.raises(IntegrityError, match=rf"{second.path}: the file's SHA256 is [0-9a-f]{{64}}, not") as caught:
        streamload.load(snapshot, device="cpu", verify=True)
    assert "Hugging Face cache" in str(caught.value)
    assert "handed out" not in str(caught.value) and not caught.value.handed_out  # load returned nothing
    # iter judges a whole file at its end: the error names what it had handed out of it by then
    handed: list[str] = []
    with pytest.raises(IntegrityError) as caught:
        for name, _ in streamload.iter(snapshot, device="cpu", verify=True, **SMALL_RING):
            handed.append(name)
    mine = [t.name for t in second.tensors]
    assert caught.value.path == second.path and caught.value.handed_out
    assert set(caught.value.handed_out) <= set(mine) & set(handed)
    assert f"handed out already: {caught.value.handed_out[0]!r}" in str(caught.value)


def test_the_callers_sha256_is_checked(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    files = sorted(model.glob("*.safetensors"))
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    assert set(streamload.load(model, device="cpu", verify=digests)) == set(reference(model))
    wrong = dict(digests, **{files[0].name: "0" * 64})
    with pytest.raises(IntegrityError, match=f"{files[0].name}: the file's SHA256 is .* as verify= says"):
        streamload.load(model, device="cpu", verify=wrong, reader="posix")
    with pytest.raises(ValueError, match="'nope.safetensors' is not a file of this checkpoint"):
        streamload.iter(model, device="cpu", verify={"nope.safetensors": "0" * 64})
    with pytest.raises(ValueError, match="not a SHA-256"):
        streamload.iter(model, device="cpu", verify={files[0].name: "xyz"})


def test_nothing_to_check_against_is_refused_before_reading(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    with pytest.raises(
        IntegrityError, match=r"no digest is known for .*model-00001-of-00002.safetensors.*streamload digest"
    ):
        streamload.iter(model, device="cpu", verify=True)


def test_a_part_of_a_file_needs_per_tensor_digests(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    snapshot = hub_cache(model, tmp_path / "cache")
    with pytest.raises(IntegrityError, match="only a whole-file digest is known .* of its tensors are left out"):
        streamload.iter(snapshot, device="cpu", verify=True, exclude="*norm*")
    write_digests(streamload.inspect(snapshot))  # next to the snapshot's links
    with streamload.iter(snapshot, device="cpu", verify=True, exclude="*norm*") as stream:
        got = dict(stream)
    assert not any("norm" in n for n in got) and stream.stats.bytes_verified == stream.stats.bytes_read


def _blocks_touched(info: streamload.TensorInfo, lo: int, hi: int) -> int:
    """Bytes of the blocks of a tensor that bytes [lo, hi) of it touch."""
    first, last = lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES
    return min(info.nbytes, (last + 1) * BLOCK_BYTES) - first * BLOCK_BYTES


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_rank_slices_are_verified_block_by_block_the_blocks_they_cut_too(tmp_path: Path, reader: str) -> None:
    model = make_model(tmp_path / "m")
    write_digests(streamload.inspect(model))
    ref = reference(model)
    ckpt = streamload.inspect(model)
    rules = {"*mlp.weight": 0, "*embed*": 1}  # rows: contiguous ranges; columns of the embedding: strided
    for rank in range(2):
        with streamload.iter(model, device="cpu", verify=True, reader=reader, shard=ShardSpec(rules, rank, 2)) as s:
            got = dict(s)
        for name, t in got.items():
            full = ref[name]
            dim = rules.get("*mlp.weight" if "mlp" in name else "*embed*" if "embed" in name else "", None)
            want = full if dim is None else full.chunk(2, dim)[rank]
            assert same_bits(t, want.contiguous()), name
        # Every block a rank's rows touch is checked whole (the strided embedding is read whole).
        touched = 0
        for name, info in ckpt.tensors.items():
            lo, hi = (rank * info.nbytes // 2, (rank + 1) * info.nbytes // 2) if "mlp" in name else (0, info.nbytes)
            touched += _blocks_touched(info, lo, hi) if info.nbytes else 0
        assert s.stats.bytes_verified == touched > s.stats.bytes_read


@pytest.mark.parametrize("reader", ["mmap", "posix"])
@pytest.mark.parametrize("where", ["head", "tail", "outside"])
def test_a_flipped_byte_in_a_block_a_slice_cuts_is_caught(tmp_path: Path, reader: str, where: str) -> None:
    """Rank 1's rows of a 2.5-block tensor start inside block 2 and end inside block 3 (its half of 2.5
    blocks: bytes 1.25..2.5 blocks): a flipped byte in its own part of the cut block 2 (head), in its
    part of block 3 (tail, which ends the tensor), or in rank 0's part of block 2 fails the load."""
    model = make_model(tmp_path / "m")
    write_digests(streamload.inspect(model))
    victim = streamload.inspect(model).tensors["model.layers.1.mlp.weight"]
    at = {"head": BLOCK_BYTES * 3 // 2, "tail": BLOCK_BYTES * 9 // 4, "outside": BLOCK_BYTES + 5}[where]
    damage(Path(victim.path), victim.begin + at)
    spec = ShardSpec({"*mlp.weight": 0}, 1, 2)
    block = "block 2 of 3" if where != "tail" else "block 3 of 3"
    with pytest.raises(IntegrityError, match=rf"'model.layers.1.mlp.weight': bytes .* \({block}\)"):
        streamload.load(model, device="cpu", verify=True, reader=reader, shard=spec)
    # rank 0 reads none of the damaged blocks in the tail case: its load passes
    if where == "tail":
        assert streamload.load(
            model, device="cpu", verify=True, reader=reader, shard=ShardSpec({"*mlp.weight": 0}, 0, 2)
        )


def test_a_stale_digest_file_is_named(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    write_digests(streamload.inspect(model))
    first = sorted(model.glob("*.safetensors"))[0]
    state = load_file(first)
    state["extra"] = torch.ones(3)
    save_file(state, first)
    with pytest.raises(IntegrityError, match=r"digests.json was made for a file of \d+ bytes, this one has"):
        streamload.iter(model, device="cpu", verify=True)
    (model / DIGEST_FILE).write_text("{not json")
    with pytest.raises(IntegrityError, match="not a digest file"):
        streamload.iter(model, device="cpu", verify=True)
    (model / DIGEST_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(IntegrityError, match="write it anew with `streamload digest`"):
        streamload.iter(model, device="cpu", verify=True)


@pytest.mark.parametrize("reader", ["mmap", "posix"])
def test_stopping_a_verified_load_leaves_no_thread(tmp_path: Path, reader: str) -> None:
    model = make_model(tmp_path / "m")
    write_digests(streamload.inspect(model))
    before = own_threads()
    for stop_after in (0, 1, 3):
        with streamload.iter(model, device="cpu", reader=reader, verify=True, **SMALL_RING) as stream:
            for k, _ in enumerate(stream):
                if k >= stop_after:
                    break
    deadline = time.monotonic() + 2
    while own_threads() - before and time.monotonic() < deadline:  # the shared reader pool may linger
        time.sleep(0.05)
    assert not {t for t in own_threads() - before if t.name.startswith("streamload-verify")}


@pytest.mark.anyio
async def test_the_async_face_verifies(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    write_digests(streamload.inspect(model))
    async with streamload.iter(model, device="cpu", verify=True, **SMALL_RING) as stream:
        got = {n: t async for n, t in stream}
    assert set(got) == set(reference(model)) and stream.stats.bytes_verified == stream.stats.bytes_read


def test_a_request_the_pool_cannot_run_finishes_its_batch_with_the_error() -> None:
    # At interpreter shutdown the thread pool refuses new work: the batch must end (with that error),
    # or whoever waits for its reads (the consumer, a verifier thread) would wait forever.
    from streamload.read.pool import ReaderPool

    pool = ReaderPool(2, lambda n: None)

    class Refusing:
        def submit(self, *args: object) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    pool._executor = Refusing()  # type: ignore[assignment]
    reads = pool.submit([lambda: 1, lambda: 2])
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        reads.wait()
    pool.close()


def test_a_changed_header_of_the_same_size_is_caught(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": random_tensor(torch.float16, (64, 64))}, model / "model.safetensors")
    write_digests(streamload.inspect(model))
    raw = (model / "model.safetensors").read_bytes()
    assert raw.count(b'"F16"') == 1
    (model / "model.safetensors").write_bytes(raw.replace(b'"F16"', b'"I16"'))
    with pytest.raises(IntegrityError, match="its header .* differs from the one"):
        streamload.iter(model, device="cpu", verify=True)


def test_strided_slices_of_long_rows_are_checked_whole(tmp_path: Path) -> None:
    # Rows of 3 MiB, a rank's half of each: ranges of 1.5 MiB at 0 and at 3 MiB; each cuts a block,
    # which is completed from the file: 4 blocks checked for 3 MiB read.
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": random_tensor(torch.float32, (2, 3 * BLOCK_BYTES // 4))}, model / "model.safetensors")
    write_digests(streamload.inspect(model))
    with streamload.iter(model, device="cpu", verify=True, shard=ShardSpec({"w": 1}, 0, 2)) as stream:
        got = dict(stream)
    assert same_bits(got["w"], load_file(model / "model.safetensors")["w"].chunk(2, 1)[0].contiguous())
    assert stream.stats.bytes_read == 3 * BLOCK_BYTES
    assert stream.stats.bytes_verified == 4 * BLOCK_BYTES
    # rank 1's columns, in the block rank 0's first range cuts
    damage(model / "model.safetensors", streamload.inspect(model).tensors["w"].begin + 7 * BLOCK_BYTES // 4)
    with pytest.raises(IntegrityError, match=r"block 2 of 6"):
        streamload.load(model, device="cpu", verify=True, shard=ShardSpec({"w": 1}, 0, 2))


def test_verify_none_or_empty_verifies_nothing(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")  # no digests known: verify=True would refuse
    for nothing in (None, False, {}):
        with streamload.iter(model, device="cpu", verify=nothing) as stream:  # type: ignore[arg-type]
            dict(stream)
        assert stream.stats.reader == "mmap" and stream.stats.bytes_verified == 0


def test_inspect_shows_an_unusable_digest_file_instead_of_failing(tmp_path: Path) -> None:
    from streamload.pipeline.verify import known_digests

    model = make_model(tmp_path / "m")
    (model / DIGEST_FILE).write_text("{broken")
    known = known_digests(streamload.inspect(model), strict=False)
    assert all(k.stale and "not a digest file" in k.stale for k in known.values())
    with pytest.raises(IntegrityError, match="not a digest file"):
        known_digests(streamload.inspect(model))


@pytest.mark.parametrize("seed", range(6))
def test_random_rings_find_every_damage_and_pass_every_clean_file(tmp_path: Path, seed: int) -> None:
    import random

    rng = random.Random(seed)
    model = make_model(tmp_path / "m")
    ref = reference(model)
    whole = seed % 2 == 1  # odd seeds: whole-file SHA-256 given by the caller; even: the digest file
    shards = sorted(model.glob("*.safetensors"))
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in shards}
    if not whole:
        write_digests(streamload.inspect(model))
    verify: bool | dict[str, str] = digests if whole else True
    for _ in range(3):
        tuning = {"ring_bytes": rng.choice([1, 2, 3]) << 20, "slots": rng.choice([2, 3]),
                  "chunk_bytes": rng.choice([64 << 10, 1 << 20]), "threads": rng.choice([1, 3])}  # fmt: skip
        reader = rng.choice(["mmap", "posix"])
        got = streamload.load(model, device="cpu", reader=reader, verify=verify, **tuning)
        assert set(got) == set(ref) and all(same_bits(got[n], t) for n, t in ref.items())
    victim = rng.choice([t for t in streamload.inspect(model).tensors.values() if t.nbytes])
    damage(Path(victim.path), rng.randrange(victim.begin, victim.end))
    with pytest.raises(IntegrityError) as caught:
        streamload.load(model, device="cpu", reader=rng.choice(["mmap", "posix"]), verify=verify, **tuning)
    assert str(victim.path) in str(caught.value)
    if not whole:
        assert repr(victim.name) in str(caught.value)
