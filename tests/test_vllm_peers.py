"""Peers on real vLLM engines (vLLM's CPU build): a node that starts while another serves and seeds loads from
it, and the store serves it nothing but headers."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import streamload

from .test_vllm import assert_same_weights, load_report
from .vllm_engines import (
    ForkedWorkers,
    Timed,
    close,
    engine,
    models,
    recording,
    scenario,
    state,
    tokens,
)


@scenario("engines")
def peers(root: Path, out: Timed) -> None:
    with recording(out, "llama/peers"):
        from_peers(root, models(root), out)


def from_peers(root: Path, paths: dict[str, Path], out: dict[str, Any]) -> None:
    """A node that starts while another serves and seeds (docs/peers.md): engine 1 loads llama from an HTTP
    store (in one file, its digest file published beside it) into cache_dir node-1 and seeds it ("seed");
    engine 2, started while engine 1 serves, loads with cache_dir node-2 and peers=[engine 1's seeder]."""
    from safetensors.torch import load_file, save_file

    from streamload.integrations.startup import prefetch
    from streamload.pipeline.verify import write_digests
    from tests.servers import RangeServer

    one = root / "store" / "llama"  # one file: the store's share of a peer's load is its header read alone
    one.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(paths["llama"].glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file(tensors, one / "model.safetensors", metadata={"format": "pt"})
    # 2 MB/s a response: slower than a peer, as a store is (engines share this process, its GIL and the machine's
    # cores with the suite: an uncapped loopback store could measure faster than the seeding engine's answers)
    server = RangeServer(root / "store", rate=2e6)
    source = f"{server.url}/llama/"
    # `streamload digest URL --out`: made from the store's object, bound to its ETag: what a peer's blocks are
    # checked against
    write_digests(streamload.inspect(source), out=one / "streamload.digests.json")
    try:
        extra = {"source": source, "cache_dir": str(root / "node-1"), "seed": {"host": "127.0.0.1", "port": 0}}
        first = engine(paths["llama"], "streamload", model_loader_extra_config=extra)
        seeding = _report_of(first)["seeding"]
        # Engine 2 stands for another node: the fetch engine 1 started, named in this process's environment
        # for the engines it starts to adopt (startup/ahead.py), is not its own.
        os.environ.pop(prefetch.ENV, None)
        before, asked, began = server.sent, len(server.requests), time.perf_counter()
        extra = {"source": source, "cache_dir": str(root / "node-2"), "peers": [seeding]}
        os.environ["STREAMLOAD_PEER_TIMEOUT"] = "30"  # a busy machine's pauses are no peer's failure here
        try:
            second = engine(paths["llama"], "streamload", model_loader_extra_config=extra)
        finally:
            os.environ.pop("STREAMLOAD_PEER_TIMEOUT", None)
        joined = round(time.perf_counter() - began, 2)
        run = {"seeding": seeding, "store_sent": server.sent - before, "seconds": joined,
               "store_requests": server.requests[asked:], "node_2": str(root / "node-2"),
               "joiner": {"tokens": tokens(second), "state": state(second)},
               "seeder": {"tokens": tokens(first), "state": state(first)},  # still serving, and seeding
               "seeding_meanwhile": _answers(seeding)}  # fmt: skip
        close(second)
        close(first)
        run["seeding_after_close"] = _answers(seeding)  # it stops with the engine's model
        out["llama/peers"] = run
    finally:
        os.environ.pop(prefetch.ENV, None)  # engine 2's, likewise: no later engine's
        server.close()


def _wave_engine(root: Path, k: int, model: Path, extra: dict[str, Any]) -> None:
    """One engine of a wave, in a process of its own: it starts its engine once every engine of the wave is
    ready, records tokens, weights, what its fetch read and from whom, serves on until all have loaded, then
    whether its seeding ended with the engine; the first also starts vLLM's own loader on the same weights
    (the reference). Its results (or its error) in `root`/result-K.json."""
    import traceback

    result: dict[str, Any] = {}
    try:
        (root / f"ready-{k}").touch()
        deadline = time.monotonic() + 240  # the others start on the same cores
        while len(list(root.glob("ready-*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        llm = engine(model, "streamload", model_loader_extra_config=extra)
        result.update(tokens=tokens(llm), state=state(llm), seeding=_report_of(llm)["seeding"])
        started = llm.llm_engine.vllm_config.load_config.model_loader_extra_config["prefetch"]
        result["fetch"] = json.loads(Path(started["done"]).read_text())
        (root / f"loaded-{k}").touch()
        deadline = time.monotonic() + 120  # serving on while the others may still read from this node
        while len(list(root.glob("loaded-*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        close(llm)
        result["seeding_after_close"] = _answers(result["seeding"])
        if k == 0:
            reference = engine(model, "safetensors")
            result["reference"] = {"tokens": tokens(reference), "state": state(reference)}
            close(reference)
    except BaseException:
        result["error"] = traceback.format_exc()
    (root / f"result-{k}.json").write_text(json.dumps(result))


@scenario("fresh")
def wave_of_engines(root: Path, out: Timed) -> Iterator[None]:
    """Three engines started together (docs/peers.md#nodes-that-start-together): each in a process of its own
    (forked from the forkserver that imported vLLM once), load format streamload, weights from an HTTP store
    (one file, its digest file beside it), its own `cache_dir`, `"seed"` on a port of its own and `"peers"`
    naming all three seeders. Started as the part's first scenario, collected after the others."""
    from streamload.pipeline.verify import write_digests
    from tests.servers import RangeServer
    from tests.test_wave_peers import free_ports

    folder = root / "wave"
    model, store = folder / "model", folder / "store" / "llama"
    store.mkdir(parents=True)
    _wave_model(model)
    shutil.copy(model / "model.safetensors", store / "model.safetensors")
    server = RangeServer(folder / "store", rate=4e6)  # a store slower than the peers on loopback
    source = f"{server.url}/llama/"
    write_digests(streamload.inspect(source), out=store / "streamload.digests.json")  # (the publisher's read)
    before = server.sent
    ports = free_ports(3)
    peers = [f"http://127.0.0.1:{port}" for port in ports]
    os.environ["STREAMLOAD_PEER_TIMEOUT"] = "15"  # a busy machine's pauses are no peer's failure here
    processes = []
    try:
        for k, port in enumerate(ports):
            extra = {"source": source, "cache_dir": str(folder / f"node-{k}"), "peers": peers,
                     "seed": {"host": "127.0.0.1", "port": port}}  # fmt: skip
            processes.append(ForkedWorkers().Process(target=_wave_engine, args=(folder, k, model, extra)))
            processes[-1].start()
        os.environ.pop("STREAMLOAD_PEER_TIMEOUT")  # (each took the environment as it started)
        yield
        with recording(out, "llama/wave"):
            runs = []
            for k, process in enumerate(processes):
                process.join(timeout=400)
                written = folder / f"result-{k}.json"
                runs.append(
                    json.loads(written.read_text()) if written.exists() else {"error": f"ended {process.exitcode}"}
                )
            out["llama/wave"] = {"engines": runs, "peers": peers, "store_sent": server.sent - before,
                                 "checkpoint": (store / "model.safetensors").stat().st_size}  # fmt: skip
    finally:
        os.environ.pop("STREAMLOAD_PEER_TIMEOUT", None)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
        server.close()


def _wave_model(folder: Path) -> None:
    """A Llama of ~80 MB in one file: ten segments of the wave (8 MiB each) for three engines to split."""
    import transformers

    torch.manual_seed(5)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                                      max_position_embeddings=256)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="1GB")


def _report_of(llm: Any) -> dict[str, Any]:
    import streamload.integrations.vllm

    return llm.collective_rpc(lambda worker: vars(streamload.integrations.vllm.last_load).copy())[0]


def _answers(url: str) -> bool:
    """Whether anything accepts connections at `url` (http://HOST:PORT)."""
    import socket

    host, port = url.split("://")[1].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def test_an_engine_started_beside_a_seeding_one_loads_from_it_exactly(engines: dict[str, Any]) -> None:
    """Engine 1 (load format streamload, weights from an HTTP store with its digest file beside them,
    `cache_dir` and `"seed"`) seeds its copies once loaded; engine 2, started while engine 1 serves, with
    `"peers": [engine 1's seeder]` and a `cache_dir` of its own: every parameter, every packed linear and the
    tokens are vLLM's own loader's; the store served engine 2 no byte past each file's header read (the
    first 256 KiB of a file, as every load's header read; the index and the digest file); engine 1 still
    serves, and its seeding stops with it."""
    run = engines["llama/peers"]
    assert run["seeding"].startswith("http://127.0.0.1:")
    reference = engines["llama/safetensors"]
    assert_same_weights(run["joiner"], reference)
    assert_same_weights(run["seeder"], reference)
    joiner = load_report(run["joiner"])
    assert joiner["bytes_read"] == joiner["bytes_total"] > 0 and joiner["staged"] == run["node_2"]
    assert run["store_sent"] == 0, run["store_requests"]  # no data request: the seeding engine served them
    data = [r for m, p, r in run["store_requests"] if p.endswith(".safetensors") and m == "GET"]
    # the header reads alone (engine 2's fetch's and its worker's): the first 256 KiB of the 9.6 MB file
    assert data and all(r == "bytes=0-262143" for r in data) and len(data) <= 2, run["store_requests"]
    assert run["seeding_meanwhile"] and not run["seeding_after_close"]


def test_three_engines_started_together_split_what_the_store_serves(engines: dict[str, Any]) -> None:
    """Three engines started together, each with `"peers"` naming all three and `"seed"` (their fetches seed
    from the engines' start): every parameter, every packed linear and the tokens are vLLM's own loader's on
    each; the store served about the checkpoint once in total (not three times); each engine's seeding
    stopped with it. (Which engine reads what from the store depends on when each fetch began: not asserted.)"""
    run = engines["llama/wave"]
    ran = run["engines"]
    assert not [r["error"] for r in ran if "error" in r], [r.get("error") for r in ran]
    reference = ran[0]["reference"]
    for r in ran:
        assert_same_weights(r, reference)
        assert r["fetch"]["ok"] and not r["fetch"]["not_cached"], r["fetch"]
        assert load_report(r)["seeding"] == r["seeding"] and r["seeding"] in run["peers"]
        assert not r["seeding_after_close"]
    assert run["store_sent"] <= 1.2 * run["checkpoint"], (run["store_sent"], [r["fetch"] for r in ran])
