"""New weights into a running vLLM engine (vLLM's CPU build), in place: `reload_weights` (test_vllm.py's
`loads` reloads its llama engine; test_vllm_tensor_parallel.py's engines reload at TP=2), vLLM's weight-sync
life-cycle on the "streamload" engine, and reloads that fail, which leave every rank serving what it served
before. (A reload whose model raises on one rank: tests/test_reload_failure.py, in a child of its own.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import streamload

from .test_vllm import kept_params, load_report
from .vllm_engines import Timed, close, engine, models, recording, scenario, state, tokens


@scenario("engines")
def fresh_engine_on_the_new_weights(root: Path, out: Timed) -> None:
    """What a reload of llama-new should serve: vLLM's own loader on it, in a fresh engine."""
    paths = models(root)
    with recording(out, "llama-new/safetensors"):
        llm = engine(paths["llama-new"], "safetensors")
        out["llama-new/safetensors"] = {"tokens": tokens(llm)}
        close(llm)


def test_reload_in_place_keeps_addresses_and_serves_the_new_weights(engines: dict[str, Any]) -> None:
    """test_vllm.py's `loads`: its streamload engine on llama, then `reload_weights` of llama-new."""
    before, after = engines["llama/streamload"], engines["llama/reloaded"]
    assert {n: p for n, (p, _) in kept_params(after).items()} == {n: p for n, (p, _) in kept_params(before).items()}
    assert after["tokens"] == engines["llama-new/safetensors"]["tokens"]  # a fresh engine on the new weights
    assert after["tokens"] != before["tokens"]
    changed = [n for n, (_, d) in kept_params(after).items() if d != kept_params(before)[n][1]]
    assert len(changed) == len(kept_params(after)) >= 6  # embeddings, norms, head: all new, in the old storage
    assert load_report(after)["through_model"] == 0  # as predicted by the dry run (which the first load checked)


@scenario("engines")
def weight_sync_engine(root: Path, out: Timed) -> None:
    with recording(out, "sync"):
        out["sync"] = weight_sync(root, models(root))


TRAINER = """
import sys, torch, streamload.commands.publish
from safetensors.torch import load_file
from pathlib import Path
root, steps = Path(sys.argv[1]), sys.argv[2:]
for k, source in enumerate(steps, 1):  # step k: the weights of the model at `source`, in small shards
    tensors = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    streamload.commands.publish.publish(tensors, root, k, shard_bytes=300_000)
"""


def weight_sync(root: Path, paths: dict[str, Path]) -> dict[str, Any]:
    """vLLM's weight-sync life-cycle on the "streamload" engine: a trainer process publishes steps, the
    engine updates to each; then an update to a corrupt step and to one cut short mid-read."""
    import subprocess

    run_dir = root / "run"
    trainer = [sys.executable, "-c", TRAINER, str(run_dir), str(paths["llama-new"]), str(paths["llama"])]
    subprocess.run([*trainer, str(paths["llama-new"]), str(paths["llama-new"])], check=True)  # steps 1-4
    out: dict[str, Any] = {}
    llm = engine(paths["llama"], "streamload", weight_transfer_config={"backend": "streamload"})
    out["start"] = {"tokens": tokens(llm), "state": state(llm)}
    llm.init_weight_transfer_engine({"init_info": {"options": {"threads": 4}}})

    def update(step: int, **info: Any) -> str:
        llm.start_weight_update()
        error = ""
        try:
            llm.update_weights({"update_info": {"path": str(run_dir / f"step-{step}"), **info}})
            llm.finish_weight_update(f"step-{step}")
        except Exception as exc:  # the engine's error, as the trainer sees it (the session ends with it)
            error = str(exc)
        llm.reset_prefix_cache()
        return error

    for step in (1, 2):
        error = update(step, verify=True)
        out[f"step-{step}"] = {"error": error, "tokens": tokens(llm), "state": state(llm)}
    corrupt = sorted((run_dir / "step-3").glob("*.safetensors"))[-1]
    with open(corrupt, "r+b") as f:  # a flipped byte in the last shard's last tensor
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0x40]))
    last = max(streamload.inspect(corrupt).tensors.values(), key=lambda t: t.end).name  # the flipped byte's
    out["step-3"] = {"error": update(3, verify=True), "tokens": tokens(llm), "state": state(llm), "file": corrupt.name,
                     "tensor": last}  # fmt: skip
    from tests.servers import RangeServer

    server = RangeServer(run_dir)  # step 4 over HTTP, from a store that stops serving it mid-update
    server.faults = ["503"] * 10_000  # every data request past a file's first 256 KiB (headers are served)
    os.environ["STREAMLOAD_RETRIES"] = "1"
    try:
        llm.start_weight_update()
        error = ""
        try:
            llm.update_weights({"update_info": {"path": f"{server.url}/step-4/"}})
            llm.finish_weight_update("step-4")
        except Exception as exc:
            error = str(exc)
        llm.reset_prefix_cache()
        served = server.data_requests()
    finally:
        del os.environ["STREAMLOAD_RETRIES"]
        server.close()
    out["step-4"] = {"error": error, "tokens": tokens(llm), "state": state(llm), "served": served}
    close(llm)
    return out


def test_weight_sync_engine_updates_in_place_and_never_half_applies(engines: dict[str, Any]) -> None:
    """vLLM's weight-sync life-cycle on the "streamload" engine: a trainer process publishes steps; the
    engine serves each as a fresh engine on those weights would; a corrupt step (a flipped byte, caught
    by the digest file) and one whose store stops serving it mid-update fail, naming the file (and the
    tensor), and the engine serves the previous step afterwards, not a mix."""
    sync = engines["sync"]
    start = sync["start"]
    addresses = {n: p for n, (p, _) in kept_params(start).items()}
    assert sync["step-1"]["error"] == "" and sync["step-2"]["error"] == ""
    assert sync["step-1"]["tokens"] == engines["llama-new/safetensors"]["tokens"]
    assert sync["step-2"]["tokens"] == engines["llama/safetensors"]["tokens"]
    assert load_report(sync["step-1"])["through_model"] == 0  # each rank's part, straight from the prediction
    step2 = {n: d for n, (_, d) in kept_params(sync["step-2"]).items()}
    for step in ("step-1", "step-2", "step-3", "step-4"):
        assert {n: p for n, (p, _) in kept_params(sync[step]).items()} == addresses, step  # in place
    corrupt = sync["step-3"]
    assert corrupt["file"] in corrupt["error"] and f"'{corrupt['tensor']}'" in corrupt["error"], corrupt["error"]
    assert "serving" in corrupt["error"] and "step-2 again" in corrupt["error"]
    assert {n: d for n, (_, d) in kept_params(corrupt).items()} == step2  # the previous step, whole
    assert corrupt["tokens"] == sync["step-2"]["tokens"]
    gone = sync["step-4"]
    assert "step-4/model-" in gone["error"] and "503" in gone["error"] and gone["served"] > 0, gone["error"]
    assert {n: d for n, (_, d) in kept_params(gone).items()} == step2
    assert gone["tokens"] == sync["step-2"]["tokens"]


def failed_reloads(llm: Any, root: Path, paths: dict[str, Path]) -> dict[str, Any]:
    """Reloads that fail mid-way (after earlier layers took new weights) or before anything arrived,
    on an engine serving llama-new (test_vllm_tensor_parallel.py's, with verify, once it reloaded): each
    must leave every rank serving llama-new at the same addresses; the engine's processes must end with it."""
    import shutil

    new = paths["llama-new"]

    def copy(name: str) -> Path:
        target = root / name
        shutil.copytree(new, target)
        return target

    flipped = copy("llama-new-flipped")  # with llama-new's digest file, a byte of rank 0's rows of the head flipped
    head = streamload.inspect(flipped).tensors["lm_head.weight"]
    with open(head.path, "r+b") as f:
        f.seek(head.begin + 100)
        byte = f.read(1)
        f.seek(head.begin + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    truncated = copy("llama-new-truncated")  # the last shard cut short
    last = sorted(truncated.glob("*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size // 2)
    missing = copy("llama-new-missing")  # a shard the index names is gone
    sorted(missing.glob("*.safetensors"))[1].unlink()
    from tests.servers import RangeServer

    out: dict[str, Any] = {}
    server = RangeServer(root)  # llama-new over HTTP from a store that stops serving mid-reload
    try:
        cases = {"flipped": str(flipped), "truncated": str(truncated), "missing": str(missing),
                 "refused": f"{server.url}/llama-new/"}  # fmt: skip
        os.environ["STREAMLOAD_RETRIES"] = "1"
        for label, where in cases.items():
            server.faults = ["503"] * 10_000 if label == "refused" else []
            error = ""
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": where})
            except Exception as exc:  # the error the caller sees
                error = str(exc)
            server.faults = []
            out[label] = {"error": error, "tokens": tokens(llm), "state": state(llm)}
        out["requests"] = server.data_requests()
    finally:
        os.environ.pop("STREAMLOAD_RETRIES", None)
        server.close()
    return out


def test_a_failed_reload_leaves_every_rank_serving_the_previous_weights(engines: dict[str, Any]) -> None:
    """TP=2, `reload_weights` from checkpoints that fail: a flipped byte in one rank's rows of the head
    (caught by verify on that rank only, after the layers before it took new weights), a shard cut
    short, a shard missing, a store refusing mid-reload. The error names what failed, and every rank
    serves the weights it served before, every parameter at the same address; no engine process is
    left once the engine is closed."""
    before = engines["llama/tp2/streamload/reloaded"]
    failed = engines["llama/tp2/streamload/failed"]
    for label in ("flipped", "truncated", "missing", "refused"):
        run = failed[label]
        assert "llama-new" in run["error"] and "serving" in run["error"], (label, run["error"])
        assert run["tokens"] == before["tokens"], label
        for rank in (0, 1):
            assert kept_params(run, rank) == kept_params(before, rank), (label, rank)
    flipped = failed["flipped"]["error"]  # rank 0's rows of the head only: rank 0 failed, rank 1 restored too
    assert "llama-new-flipped" in flipped and "rank 0: " in flipped and "'lm_head.weight'" in flipped, flipped
    assert "rank 1: " not in flipped, flipped
    assert "503" in failed["refused"]["error"] and failed["requests"] > 0
    assert "model-00003" in failed["missing"]["error"] or "missing" in failed["missing"]["error"]
    assert engines["llama/tp2/streamload/left"] == []
