"""`streamload serve -- COMMAND`: the weights fetched from the moment the command starts, handed to the
server through its environment; the command's exit status, signals passed on, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from streamload.commands.serve import _weights
from streamload.integrations.startup import prefetch

from .servers import RangeServer

SERVE = [sys.executable, "-m", "streamload", "serve"]

# The "server": finds the fetch in its environment, loads the weights from its staging directory
# (each file as the fetch completes it), checks them, and exits 3.
SERVER = """
import json, os, sys
import torch, streamload
from streamload.integrations.startup import prefetch
started = prefetch.adopt(sys.argv[1])
assert started is not None and started["owned"], os.environ.get(prefetch.ENV)
state = streamload.load(sys.argv[1], device="cpu", cache_dir=started["cache_dir"])
assert all(torch.equal(t, torch.full_like(t, float(n.split(".")[2]))) for n, t in state.items())
print(json.dumps(started), flush=True)
sys.exit(3)
"""


def _store(root: Path) -> Path:
    store = root / "m"
    store.mkdir(parents=True)
    tensors = {f"model.layers.{i}.w": torch.full((256, 512), float(i)) for i in range(4)}
    for i in range(2):
        save_file(
            {k: v for k, v in tensors.items() if int(k.split(".")[2]) // 2 == i}, str(store / f"s{i}.safetensors")
        )
    index = {"weight_map": {k: f"s{int(k.split('.')[2]) // 2}.safetensors" for k in tensors}}
    (store / "model.safetensors.index.json").write_text(json.dumps(index))
    return store


def test_the_server_finds_the_fetch_in_its_environment_and_nothing_is_left(tmp_path: Path) -> None:
    store = _store(tmp_path / "store")
    server = RangeServer(tmp_path / "store", rate=2 << 20)
    try:
        url = f"{server.url}/m/"
        out = subprocess.run([*SERVE, "--source", url, "--", sys.executable, "-c", SERVER, url],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 3, out.stderr
        started = json.loads(out.stdout.strip().splitlines()[-1])
        assert not Path(started["cache_dir"]).exists() and not Path(started["done"]).parent.exists()
        assert not _alive(started["pid"])  # the fetch ended with the command
        checkpoint = sum(f.stat().st_size for f in store.glob("*.safetensors"))
        assert server.sent <= checkpoint * 1.05  # downloaded once, by the fetch: the server waited for its copies
    finally:
        server.close()


def test_signals_reach_the_server_and_its_status_comes_back(tmp_path: Path) -> None:
    child = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
             "print('ready', flush=True); time.sleep(60)")  # fmt: skip
    model = _store(tmp_path)
    serve = subprocess.Popen([*SERVE, "--source", str(model), "--", sys.executable, "-c", child],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert serve.stdout is not None and serve.stdout.readline().strip() == "ready"
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(timeout=30) == 7
    serve.stdout.close()


def test_a_command_that_cannot_run_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([*SERVE, "--source", str(_store(tmp_path)), "--", "no-such-server-command"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1 and "cannot run 'no-such-server-command'" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_weights_are_found_in_vllms_arguments(tmp_path: Path) -> None:
    local = _store(tmp_path)
    assert _weights(["vllm", "serve", "s3://b/m/", "--load-format", "streamload"], None, None)[:2] == (
        "s3://b/m/",
        None,
    )
    assert _weights(["vllm", "serve", str(local)], None, None)[:2] == (str(local), None)
    extra = '{"source": "https://h/m/", "cache_dir": "/var/cache/w"}'
    got = _weights(["vllm", "serve", "cfg/", "--model-loader-extra-config", extra], None, None)[:2]
    assert got == ("https://h/m/", Path("/var/cache/w"))
    got = _weights(["vllm", "serve", "--model=cfg/", f"--model-loader-extra-config={extra}"], None, None)[:2]
    assert got == ("https://h/m/", Path("/var/cache/w"))
    assert _weights(["vllm", "serve", "meta-llama/Llama-3.1-8B"], None, None)[:2] == (None, None)  # vLLM downloads it
    assert _weights(["vllm", "serve", "org/m"], "s3://b/x/", None)[:2] == ("s3://b/x/", None)
    with pytest.raises(ValueError, match="--model-loader-extra-config is not a JSON object"):
        _weights(["vllm", "serve", "m", "--model-loader-extra-config", "{source"], None, None)


def test_adopting_takes_the_fetch_once_and_only_for_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _store(tmp_path)
    monkeypatch.delenv(prefetch.ENV, raising=False)
    started = prefetch.ahead(str(model))
    assert prefetch.adopt("s3://other/") is None and prefetch.ENV in os.environ
    assert prefetch.adopt(str(model) + "/") == started  # the same directory, however it is written
    assert prefetch.adopt(str(model)) is None  # once
    assert prefetch.wait(Path(started["done"]), started["pid"], timeout=30)["ok"]


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True
