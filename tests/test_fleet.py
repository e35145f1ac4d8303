"""Loads across real network hops, on one machine (testbed/netsim.py): a storage host serving the
checkpoint over HTTP like an object store — a first-byte latency per request, a rate cap per
connection and on its link — and nodes in network namespaces of their own. Needs root, `ip`, `tc` and
nginx with the echo module (CI installs them); skipped, saying why, elsewhere."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamload.format.header import FIRST_READ
from testbed.fleet_node import start
from testbed.netsim import Net

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(bool(Net.missing()), reason=f"no simulated network here: {Net.missing()}")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12 MB sharded checkpoint, bf16, llama-named, in a directory the store serves."""
    root = tmp_path_factory.mktemp("store")
    torch.manual_seed(0)
    for shard in range(3):
        tensors = {f"model.layers.{shard * 2 + k}.mlp.{w}.weight": torch.randn(512, 1024, dtype=torch.bfloat16)
                   for k in range(2) for w in ("up_proj", "down_proj")}  # fmt: skip
        tensors[f"model.layers.{shard * 2}.input_layernorm.weight"] = torch.randn(512)
        save_file(tensors, str(root / f"model-{shard}.safetensors"))
    return root


def _urls(net: Net) -> list[str]:
    return [f"{net.url}model-{shard}.safetensors" for shard in range(3)]


def _expected(store: Path) -> dict[str, str]:
    digests = {}
    for f in sorted(store.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            digests[name] = hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy()).hexdigest()
    return digests


def _result(proc: Any, timeout: float = 60) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_one_node_from_a_capped_latent_store_is_exact_and_served_once(store: Path) -> None:
    nbytes = sum(f.stat().st_size for f in store.glob("*.safetensors"))
    with Net(store, nodes=1, storage_mbit=400, first_byte_ms=30, connection_mbps=20) as net:
        probe = net.run_on("n0", ["curl", "-s", "-o", "/dev/null", "-w", "%{time_starttransfer}", "-r", "0-0",
                                  _urls(net)[0]], timeout=10)  # fmt: skip
        assert probe.returncode == 0 and 0.03 <= float(probe.stdout) < 0.5  # the store's first-byte latency
        before = net.served()
        result = _result(start(net, 0, _urls(net)))
        served = net.served() - before
    assert result["digests"] == _expected(store)  # bit for bit, as safetensors' load_file reads them
    assert nbytes <= served <= nbytes + _first_reads(store)  # each byte once, and each file's header read
    assert result["read"] == sum(t.stat().st_size for t in store.glob("*")) - _header_bytes(store)


@pytest.mark.parametrize("join", ["group", "env"])
def test_a_fleet_of_three_loads_cooperatively_and_storage_serves_the_checkpoint_once(store: Path, join: str) -> None:
    """Three replicas, each wanting the whole model, in a gloo group over their own links — one the
    nodes initialised (`join="group"`), or, with only torch's launch variables set (MASTER_ADDR, ...,
    as torchrun sets them), one streamload forms: storage serves each byte about once, and every node
    ends with exact tensors."""
    nbytes = sum(f.stat().st_size for f in store.glob("*.safetensors"))
    with Net(store, nodes=3, storage_mbit=400, first_byte_ms=30, connection_mbps=20) as net:
        master = f"{net.node_ips[0]}:29517"
        before = net.served()
        procs = [start(net, i, _urls(net), "--rank", str(i), "--world", "3", "--master", master, "--join", join)
                 for i in range(3)]  # fmt: skip
        results = [_result(p, timeout=90) for p in procs]
        served = net.served() - before
    expected = _expected(store)
    assert all(r["digests"] == expected for r in results)
    # not 3x: each node read a share and got the rest (and every node read every file's header)
    assert served <= nbytes + 3 * _first_reads(store), served / nbytes
    assert sum(r["read"] for r in results) <= 1.02 * nbytes


def _first_reads(store: Path) -> int:
    """What reading each file's header asks for (a first read of `FIRST_READ` bytes, or the file)."""
    return sum(min(FIRST_READ, f.stat().st_size) for f in store.glob("*.safetensors"))


def _header_bytes(store: Path) -> int:
    total = 0
    for f in store.glob("*.safetensors"):
        with f.open("rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


def test_a_node_that_dies_mid_load_costs_the_others_only_time(store: Path) -> None:
    """Node 1 of a fleet of three (formed from the launch variables) dies after its first tensors (1 MiB
    slots: many exchanges still to come): the other two name it lost, form a group of their own, read
    its share from storage a half each, and end with exact tensors (no hang, no error); storage serves
    its share once, not once per survivor."""
    nbytes = sum(f.stat().st_size for f in store.glob("*.safetensors"))
    ring = 4 << 20
    with Net(store, nodes=3, storage_mbit=400, first_byte_ms=30, connection_mbps=20) as net:
        master = f"{net.node_ips[0]}:29517"
        before = net.served()
        procs = [
            start(net, i, _urls(net), "--rank", str(i), "--world", "3", "--master", master, "--join", "env",
                  "--options", json.dumps({"ring_bytes": ring, "slots": 4}), *(["--die-after", "2"] if i == 1 else []))
            for i in range(3)
        ]  # fmt: skip
        survivors = {}
        for i in (0, 2):
            out, err = procs[i].communicate(timeout=90)
            assert procs[i].returncode == 0, err[-3000:]
            assert "ranks [1] of the first group are lost: 2 ranks go on together" in err, err[-3000:]
            survivors[i] = json.loads(out.strip().splitlines()[-1])
        procs[1].communicate(timeout=30)
        assert procs[1].returncode == 3
        served = net.served() - before
    expected = _expected(store)
    assert all(r["digests"] == expected for r in survivors.values())
    # once, plus what the lost node had read into its ring before it died and every node's headers
    assert served <= nbytes + ring + 3 * _first_reads(store), served / nbytes


@pytest.mark.parametrize("s3", [False, True], ids=["http", "s3"])
def test_a_throttling_store_under_load_is_retried_past_and_a_failing_one_named(store: Path, s3: bool) -> None:
    """A sixth of the data requests answered 503 (S3's SlowDown) and a twentieth dropped unanswered
    while the link is capped: the load retries them with backoff and jitter and is exact; a store that
    refuses every request is a `ReadError` naming the object and the byte range."""
    # With a fifth failing, 5 attempts (the default) leave a request a 1-in-3125 chance of failing every
    # time, which across a load's requests made this test fail about once in 15 runs: 9 attempts here.
    faults = {"slow_down_percent": 15, "reset_percent": 5}
    with Net(store, nodes=1, storage_mbit=400, first_byte_ms=20, connection_mbps=20, s3=s3, **faults) as net:
        os.environ["STREAMLOAD_RETRIES"] = "8"
        try:
            result = _result(start(net, 0, _urls(net)))
        finally:
            del os.environ["STREAMLOAD_RETRIES"]
    assert result["digests"] == _expected(store)
    with Net(store, nodes=1, slow_down_percent=100, s3=s3) as net:
        env = {**net.env(), "STREAMLOAD_RETRIES": "2", "STREAMLOAD_TIMEOUT": "2"}
        done = net.run_on(
            "n0", [sys.executable, "-m", "testbed.fleet_node", _urls(net)[0]], timeout=60, cwd=ROOT, env=env
        )
    assert done.returncode != 0
    named = rf"ReadError: {re.escape(_urls(net)[0])}: .*(503|Service Unavailable|SlowDown)"
    assert re.search(named, done.stderr), done.stderr[-2000:]
