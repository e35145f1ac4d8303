"""Peers on real vLLM engines (vLLM's CPU build): a node that starts while another serves and seeds loads from
it, and the store serves it nothing but headers."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

import streamload

from .test_vllm import assert_same_weights, load_report
from .vllm_engines import Timed, close, engine, models, recording, scenario, state, tokens


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
