"""The end of a reload decides on every rank of the engine at once (integrations/vllm/restore.py), over
a process group shaped as vLLM shapes pipeline parallel 2 x tensor parallel 2: four processes (gloo),
tensor-parallel groups [0, 1] (stage 0) and [2, 3] (stage 1)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from streamload.integrations.vllm.restore import Ranks

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
