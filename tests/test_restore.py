"""The end of a reload decides on every rank of the engine at once (integrations/vllm/ranks.py), over
a process group shaped as vLLM shapes pipeline parallel 2 x tensor parallel 2: four processes (gloo),
tensor-parallel groups [0, 1] (stage 0) and [2, 3] (stage 1)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn

from streamload.integrations.vllm.ranks import Ranks

STAGES = [[0, 1], [2, 3]]  # vLLM's tensor-parallel groups at TP=2, PP=2: stage s holds ranks 2s, 2s+1


def _rank(rank: int, world: int, out: str, failing: list[int]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))  # fmt: skip
    tp_groups = [dist.new_group(ranks) for ranks in STAGES]  # every rank makes every group, as vLLM does
    stage = rank // 2
    ok = rank not in failing
    engine, stage_only = Ranks(dist.group.WORLD), Ranks(tp_groups[stage])
    voted = engine.vote(ok, touched=ok)  # a failing rank had put nothing in; the others had
    result: dict[str, Any] = {
        "world": engine.world,
        "ok": voted[0],
        "touched": voted[1],
        "reasons": engine.reasons("" if ok else f"shard missing on rank {rank}") if not voted[0] else [],
        "raises": engine.last,
        "stage_alone_ok": stage_only.vote(ok, touched=ok)[0],  # what a vote of the stage alone decides
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(tmp_path: Path, failing: list[int]) -> list[dict[str, Any]]:
    mp.start_processes(_rank, args=(4, str(tmp_path), failing), nprocs=4, start_method="fork")  # vLLM imported once
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


def test_a_stage_that_fails_makes_every_stage_restore(tmp_path: Path) -> None:
    results = run(tmp_path, failing=[1])  # stage 0's second tensor-parallel rank fails; stage 1 succeeds
    assert [r["stage_alone_ok"] for r in results] == [False, False, True, True]  # stages alone: a mix
    assert all(r["world"] == 4 for r in results)
    assert all(r["ok"] is False and r["touched"] is True for r in results)  # every stage puts its layers back
    assert all(r["reasons"] == ["", "shard missing on rank 1", "", ""] for r in results)
    assert [r["raises"] for r in results] == [False, False, False, True]  # once, by the engine's last rank


def test_a_rank_alone_decides_alone() -> None:
    alone = Ranks(None)
    assert alone.vote(False, True) == (False, True) and alone.vote(True, False) == (True, False)
    assert alone.reasons("why") == ["why"] and alone.last


# -- a failed reload on a real vLLM layerwise reload: what is read again, and when the vote is lost --------

ROWS = 64


class _Weights(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, ROWS), requires_grad=False)


class Toy(nn.Module):
    """Three layers, each parameter filled through its weight loader, as vLLM's models fill theirs (vLLM's
    layerwise reload wraps those loaders to process each layer once it is complete)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = _Weights(16)
        self.layers = nn.ModuleList(_Weights(ROWS) for _ in range(3))

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())  # during a reload: the layers' meta stand-ins
        for name, t in pairs:
            getattr(params[name], "weight_loader", default_weight_loader)(params[name], t)
        return set(params)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, ROWS, generator=g)} | {
        f"layers.{i}.weight": torch.randn(ROWS, ROWS, generator=g) for i in range(3)
    }


def write(folder: Path, tensors: dict[str, torch.Tensor], digests: bool = True) -> Path:
    """A checkpoint folder (one file, named as an HTTP store finds it) with its digest file."""
    import streamload
    from streamload.pipeline.verify import write_digests

    folder.mkdir(exist_ok=True)
    temporary = folder / ".model.tmp"
    save_file(tensors, str(temporary))
    os.replace(temporary, folder / "model.safetensors")  # a new file (inode), as a publisher writes one
    if digests:
        write_digests(streamload.inspect(folder))
    return folder / "model.safetensors"


def flip(folder: Path, tensor: str) -> None:
    """A byte of `tensor` flipped after the digest file was written (verify catches it mid-stream)."""
    import streamload

    info = streamload.inspect(folder).tensors[tensor]
    with open(info.path, "r+b") as f:
        f.seek(info.begin + 7)
        byte = f.read(1)
        f.seek(info.begin + 7)
        f.write(bytes([byte[0] ^ 0x40]))


@dataclass
class Served:
    """A toy model first loaded by streamload from `old`, and what it takes to reload it as vLLM does."""

    model: Toy
    config: Any
    load_config: Any
    addresses: dict[str, int]

    def reload(self, where: str) -> str:
        """vLLM's own `reload_weights(weights_path=...)` (a new loader, the layerwise reload): its error."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        vllm_config = SimpleNamespace(model_config=self.config, load_config=self.load_config,
                                      lora_config=None, quant_config=None)  # fmt: skip
        try:
            reload_weights(vllm_config, self.model, None, weights_path=where, is_checkpoint_format=True)
        except Exception as exc:
            return str(exc)
        return ""

    def state(self) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        assert {n: p.data_ptr() for n, p in params.items()} == self.addresses  # in place: the same storage
        assert not any(p.is_meta for p in params.values())  # every layer put back
        return {n: p.detach().clone() for n, p in params.items()}


def serve(where: str, **options: Any) -> Served:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from streamload.integrations.vllm import StreamloadModelLoader, register

    register()  # vLLM's reload asks its registry for the "streamload" loader
    # a ring slot a layer: verify hands each layer out once its bytes matched, before the next is checked
    small = {"ring_bytes": 4 * ROWS * ROWS * 4, "slots": 4}
    load_config = LoadConfig(load_format="streamload", model_loader_extra_config=small | options)
    model = Toy()
    record_metadata_for_reloading(model)  # as vLLM does when it builds a model
    config = SimpleNamespace(model=where, revision=None, model_weights="", quantization=None, dtype=torch.float32)
    StreamloadModelLoader(load_config).load_weights(model, config)
    return Served(model, config, load_config, {n: p.data_ptr() for n, p in model.named_parameters()})


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _failing_reload(tmp_path: Path) -> str:
    """A new checkpoint whose last layer is damaged: the embedding and layers 0-1 arrive first."""
    write(tmp_path / "new", weights(2))
    flip(tmp_path / "new", "layers.2.weight")
    return str(tmp_path / "new")


def _changed_restore(served: Served, new: str, old: dict[str, torch.Tensor], changed: str) -> None:
    """The failed reload's restore refuses: its error says the weights could not be restored because
    files changed, naming `changed`; the layers are back as vLLM's finalisation leaves them (what
    arrived processed, the rest the previous weights), no byte of the changed file read."""
    error = served.reload(new)
    assert "cannot be restored" in error and "changed since" in error and changed in error, error
    assert "weights are a mix; restart it" in error, error
    arrived = {n: t for n, t in weights(2).items() if n != "layers.2.weight"}
    assert_equal(served.state(), arrived | {"layers.2.weight": old["layers.2.weight"]})


def _restores_first(served: Served, new: str, old: dict[str, torch.Tensor]) -> None:
    """Unchanged, the files loaded first are read again: the previous weights, whole."""
    error = served.reload(new)
    assert "serving" in error and "again" in error and "layers.2.weight" in error, error
    assert_equal(served.state(), old)


def test_a_restore_refuses_a_local_file_replaced_since_it_was_loaded(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    old = weights(1)
    file = write(tmp_path / "old", old)
    served, new = serve(str(tmp_path / "old"), verify=True), _failing_reload(tmp_path)
    _restores_first(served, new, old)
    write(tmp_path / "old", weights(3))  # another file in its place, same size
    _changed_restore(served, new, old, f"{file}: replaced by another file (inode ")


def test_a_restore_refuses_a_file_rewritten_in_place_with_its_mtime_kept(tmp_path: Path) -> None:
    """Same inode, size and mtime (rewritten in place, the mtime set back, its digest file written
    anew): only the digests `verify` checked it against tell, and they are recorded too."""
    import streamload
    from streamload.pipeline.verify import write_digests

    pytest.importorskip("vllm")
    old = weights(1)
    file = write(tmp_path / "old", old)
    served, new = serve(str(tmp_path / "old"), verify=True), _failing_reload(tmp_path)
    _restores_first(served, new, old)
    st = file.stat()
    info = streamload.inspect(tmp_path / "old").tensors["layers.2.weight"]
    with open(file, "r+b") as f:
        f.seek(info.begin)
        f.write(torch.ones(ROWS, ROWS).numpy().tobytes())
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    write_digests(streamload.inspect(tmp_path / "old"))
    assert (file.stat().st_ino, file.stat().st_size, file.stat().st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    _changed_restore(served, new, old, f"{file}: digest blocks:")


def test_a_restore_refuses_an_object_whose_etag_changed(tmp_path: Path) -> None:
    """Weights first loaded over HTTP: the object changed since (another ETag) is not read again."""
    from .servers import RangeServer

    pytest.importorskip("vllm")
    pytest.importorskip("obstore")
    old = weights(1)
    write(tmp_path / "old", old)
    server = RangeServer(tmp_path)
    try:
        url = f"{server.url}/old/"
        served, new = serve(url, verify=True), _failing_reload(tmp_path)
        _restores_first(served, new, old)
        time.sleep(0.01)  # (the server's ETag is of the mtime and size)
        write(tmp_path / "old", weights(3))
        _changed_restore(served, new, old, f"{url}model.safetensors: ETag ")
    finally:
        server.close()


def _engine_rank(rank: int, root: str, peer: str, group_timeout: int) -> None:
    """Rank `rank` of a two-worker engine on vLLM's own world group (gloo): both load the toy; then
    rank 1, the `peer`, never votes: it "dies" (exits) or "hangs" (alive, never calling the vote) once
    rank 0 reloads, as vLLM does, and records what its reload's end made of the lost vote."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment

    parallel = ParallelConfig(cpu_distributed_timeout_seconds=group_timeout)  # the vote's bound
    with set_current_vllm_config(VllmConfig(parallel_config=parallel)):
        init_distributed_environment(2, rank, f"file://{root}/pg", rank, "gloo")
    served = serve(f"{root}/old")
    reloading = Path(root, "reloading")
    if rank == 1:
        deadline = time.monotonic() + 120
        while not reloading.exists() and time.monotonic() < deadline:  # rank 0 is done with the first load
            time.sleep(0.01)
        if peer == "hangs":
            time.sleep(group_timeout + 60)  # (the test ends it sooner)
        os._exit(0)
    reloading.touch()
    began = time.monotonic()
    error = served.reload(f"{root}/new")
    seconds = time.monotonic() - began
    try:
        restored = all(torch.equal(t, weights(1)[n]) for n, t in served.state().items())
    except AssertionError as exc:  # a parameter left on meta, or moved
        restored = False
        error += f" [{exc!r}]"
    Path(root, "survivor.json").write_text(json.dumps({"error": error, "seconds": seconds, "restored": restored}))
    os._exit(0)  # no teardown: the peer is gone


def _survive(tmp_path: Path, peer: str, group_timeout: int) -> dict[str, Any]:
    pytest.importorskip("vllm")
    from streamload.integrations.vllm import StreamloadModelLoader  # noqa: F401  (imported once, before the fork)

    write(tmp_path / "old", weights(1), digests=False)
    write(tmp_path / "new", weights(2), digests=False)  # a reload that succeeds on the survivor
    context = mp.get_context("fork")
    ranks = [context.Process(target=_engine_rank, args=(r, str(tmp_path), peer, group_timeout)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        ranks[0].join(timeout=group_timeout + 120)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(5)
    assert ranks[0].exitcode == 0, f"the survivor did not end (exit code {ranks[0].exitcode})"
    return json.loads((tmp_path / "survivor.json").read_text())


def test_a_peer_that_dies_before_voting_leaves_the_survivor_serving_its_previous_weights(tmp_path: Path) -> None:
    """The survivor's vote fails (the peer's connections closed): it asks the broken group nothing more,
    puts its layers back, reads its previous weights over them and raises, naming why, at once."""
    result = _survive(tmp_path, "dies", group_timeout=600)
    assert result["restored"], result["error"]
    assert "serving" in result["error"] and "could not vote" in result["error"], result["error"]
    assert result["seconds"] < 30, result  # not the group's timeout (600 s): a dead peer is seen at once


def test_a_peer_that_hangs_before_voting_is_given_up_on_after_the_groups_timeout(tmp_path: Path) -> None:
    """A peer alive but never voting: the vote waits the group's timeout (vLLM's
    `cpu_distributed_timeout_seconds`), no longer, and the survivor restores as above."""
    result = _survive(tmp_path, "hangs", group_timeout=3)
    assert result["restored"], result["error"]
    assert "could not vote" in result["error"] and "3000ms" in result["error"], result["error"]
    assert 3 <= result["seconds"] < 3 + 30, result
