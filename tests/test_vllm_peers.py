"""Peers on real vLLM engines (tests/vllm_engines.py's `from_peers`): a node that starts while another serves
and seeds loads from it, and the store serves it nothing but headers."""

from __future__ import annotations

from typing import Any

from .test_vllm import _report, _same_weights


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
    _same_weights(run["joiner"], reference)
    _same_weights(run["seeder"], reference)
    joiner = _report(run["joiner"])
    assert joiner["bytes_read"] == joiner["bytes_total"] > 0 and joiner["staged"] == run["node_2"]
    assert run["store_sent"] == 0, run["store_requests"]  # no data request: the seeding engine served them
    data = [r for m, p, r in run["store_requests"] if p.endswith(".safetensors") and m == "GET"]
    # the header reads alone (engine 2's fetch's and its worker's): the first 256 KiB of the 9.6 MB file
    assert data and all(r == "bytes=0-262143" for r in data) and len(data) <= 2, run["store_requests"]
    assert run["seeding_meanwhile"] and not run["seeding_after_close"]
