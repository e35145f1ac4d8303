"""A load's wait on a server that accepts requests and then answers none is bounded: about
STREAMLOAD_TIMEOUT x (STREAMLOAD_RETRIES + 1), however many ranges are in flight or queued behind the
store's connection cap, and the error says how long it waited in all; each wait is logged as it happens."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload

from .cli_runs import cli, one_line_error
from .servers import RangeServer

pytest.importorskip("obstore")

TIMEOUT, RETRIES = 1, 1
BOUND = TIMEOUT * (RETRIES + 1) * 2 + 3  # twice the budget, plus slack for the headers and the close
STALL = 5  # seconds each faulted request hangs: longer than a request's timeout, short enough to wait out


@pytest.fixture
def stalling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RangeServer]:
    """Three 4 MB files (48 ranges of 256 KiB, three times the 16 connections a store starts with) on a
    server whose every data request hangs; its handler threads are waited out at the end."""
    monkeypatch.setenv("STREAMLOAD_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("STREAMLOAD_RETRIES", str(RETRIES))
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        tensors = {f"model.layers.{i}.mlp.w{j}": torch.randn(256, 1024, generator=g) for j in range(4)}
        save_file(tensors, str(tmp_path / f"model-{i}.safetensors"))
    server = RangeServer(tmp_path)
    server.faults = [f"stall:{STALL}"] * 1000
    try:
        yield server
    finally:
        server.faults = []
        deadline = time.monotonic() + STALL + 10
        while server.open and time.monotonic() < deadline:  # the stalled handlers end once their sleep does
            time.sleep(0.1)
        server.close()
        assert not server.open, "stalled handler threads outlived the test"


def test_a_stalled_server_fails_the_whole_load_within_timeout_times_attempts(stalling: RangeServer) -> None:
    urls = [f"{stalling.url}/model-{i}.safetensors" for i in range(3)]
    start = time.monotonic()
    with pytest.raises(streamload.ReadError) as caught:
        streamload.load(urls, device="cpu")
    took = time.monotonic() - start
    assert took < BOUND, f"the load failed after {took:.1f} s, not within {BOUND} s"
    message = str(caught.value)
    assert re.search(rf"{re.escape(stalling.url)}/model-\d\.safetensors: reading bytes \d+-\d+", message), message
    waited = re.search(r"([\d.]+) s in all", message)
    # the message rounds to a tenth of a second: 2.16 s waited reads "2.2 s" in a load that took 2.18 s
    assert waited and TIMEOUT * (RETRIES + 1) * 0.9 <= float(waited[1]) <= took + 0.05, message
    assert "STREAMLOAD_TIMEOUT" in message and "STREAMLOAD_RETRIES" in message
    assert stalling.data_requests() >= 16  # many ranges were in flight at once: not one at a time


def test_a_stream_of_a_stalled_server_fails_within_the_bound_too(stalling: RangeServer) -> None:
    """Through iter(), with small slots: many reads in turn, each with its ranges; the first tensor never comes."""
    start = time.monotonic()
    with pytest.raises(streamload.ReadError) as caught:
        with streamload.iter(f"{stalling.url}/model-0.safetensors", device="cpu", chunk_bytes=256 << 10) as stream:
            for _ in stream:
                pass
    took = time.monotonic() - start
    assert took < BOUND, f"the stream failed after {took:.1f} s, not within {BOUND} s"
    assert re.search(r"[\d.]+ s in all", str(caught.value)), caught.value


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never sends a byte back."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # and never a byte back
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/model/"
    stop.set()
    listener.close()
    for conn in held:
        conn.close()


def test_an_unanswering_server_is_logged_as_it_is_waited_for_then_named(silent_server: str) -> None:
    env = {**os.environ, "STREAMLOAD_TIMEOUT": "1", "STREAMLOAD_RETRIES": "2"}
    started = time.monotonic()
    run = cli("load", silent_server, "--device", "cpu", env=env, timeout=120)
    assert time.monotonic() - started < 60
    waits = [line for line in run.stderr.splitlines() if "got no answer within 1 s; trying again" in line]
    assert len(waits) == 2 and all(silent_server in line for line in waits), run.stderr
    one_line_error(run, silent_server, "got no answer within 1 s in 3 of 3 attempts", "STREAMLOAD_TIMEOUT")
