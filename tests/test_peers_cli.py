"""Peers and seeding from the command line (`streamload load/prefetch --peers`, `streamload serve --peers
--seed`) in processes of their own, and the vLLM load format's "seed" option: its checks, and the seeding
its worker starts once loaded (seeding.py, run here outside an engine; in engines: tests/test_vllm_peers.py).
The store is tests/servers.py's RangeServer, the peers are seeders, all on 127.0.0.1."""

from __future__ import annotations

import gc
import http.client
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import streamload
from streamload.storage.peers import url_path
from streamload.storage.remote import ObjectPath
from streamload.storage.verified import COPY

from .test_peers import Store, assert_same, proved, read_key_of, seeders, sent, store, warnings_of

__all__ = ["store"]  # the module's fixture, shared: one store and seeded cache for this module

pytest.importorskip("obstore")
pytest.importorskip("xxhash")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "1")
    monkeypatch.setenv("STREAMLOAD_RETRIES", "2")
    monkeypatch.delenv("STREAMLOAD_PEERS_UNVERIFIED", raising=False)


def streamload_command(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamload", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def assert_copies_exact(store: Store, cache: Path) -> None:
    """`cache` holds a complete copy of every file of the model, byte for byte the store's."""
    host = store.server.url.split("://")[1].replace(":", "_")
    originals = sorted((store.www / "model").glob("*.safetensors"))
    for original in originals:
        assert (cache / "http" / host / "model" / original.name).read_bytes() == original.read_bytes()
    assert_same(streamload.load(store.url, device="cpu", cache_dir=cache), store.www / "model")


def test_load_command_reads_from_peers(store: Store, tmp_path: Path) -> None:
    before = sent(store)
    with seeders(store.seeded) as (peer,):
        done = streamload_command("load", store.url, "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
                                  "--peers", peer.url)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert sent(store) == before and peer.sent > 0  # no tensor byte from the store
    assert "tensors" in done.stdout and "WARNING" not in done.stderr, done.stderr
    assert_copies_exact(store, tmp_path / "c")


def test_prefetch_command_reads_from_peers_named_several_ways(store: Store, tmp_path: Path) -> None:
    refused = socket.create_server(("127.0.0.1", 0))
    down = f"http://127.0.0.1:{refused.getsockname()[1]}"
    refused.close()  # nothing listens there: one warning, and the others serve
    before = sent(store)
    with seeders(store.seeded, 2) as (a, b):
        done = streamload_command("prefetch", store.url, "--cache-dir", str(tmp_path / "c"), "--peers",
                                  f"{a.url},{down}", "--peers", b.url)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert sent(store) == before and a.sent + b.sent > 0
    assert "3 file(s) complete there" in done.stdout, done.stdout
    assert done.stderr.count(down) == 1 and "dropped" in done.stderr, done.stderr
    assert_copies_exact(store, tmp_path / "c")


WAIT_FOR = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"


def _head(url: str, path: str, key: bytes, complete: bool = False) -> int | None:
    """The status a HEAD of `path` gets from the seeder at `url` (None: nothing answers); `complete`: 200 only
    for a complete copy (a copy in progress answers 200 too, saying "loading")."""
    host, port = url.split("://")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    try:
        conn.request("HEAD", path, headers=proved(key, "HEAD", path))
        response = conn.getresponse()
        loading = (response.getheader(COPY) or "").startswith("loading")
        return 0 if complete and loading else response.status
    except OSError:
        return None
    finally:
        conn.close()


def test_serve_fetches_from_peers_then_seeds_until_its_server_exits(store: Store, tmp_path: Path) -> None:
    """`streamload serve --peers A --seed HOST:0 --cache-dir C`: its fetch reads from A (the store serves no
    tensor byte) and seeds C from its start; once fetched, C's copies are served to a late joiner (the store
    serves it none either); seeding stops with the server."""
    cache, stop = tmp_path / "c", tmp_path / "stop"
    before = sent(store)
    with seeders(store.seeded) as (a,):
        serve = subprocess.Popen(
            [sys.executable, "-m", "streamload", "serve", "--source", store.url, "--cache-dir", str(cache), "--peers",
             a.url, "--seed", "127.0.0.1:0", "--", sys.executable, "-c", WAIT_FOR, str(stop)],
            cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True,  # its server too, on a failure
        )  # fmt: skip
        try:
            assert serve.stderr is not None
            said, _, _ = select.select([serve.stderr], [], [], 60)  # bounded: a serve that says nothing fails
            line = serve.stderr.readline() if said else "(nothing within 60 s)"
            assert f"streamload serve: seeding {cache} at http://127.0.0.1:" in line, line
            url = next(w for w in line.split() if w.startswith("http://"))
            last = url_path(ObjectPath(f"{store.url}model-00003-of-00003.safetensors"))
            key = read_key_of(f"{store.url}model-00003-of-00003.safetensors")
            deadline = time.monotonic() + 60
            while _head(url, last, key, complete=True) != 200:  # the fetch has ended, every copy complete
                assert serve.poll() is None and time.monotonic() < deadline, serve.stderr.read()
                time.sleep(0.1)
            assert sent(store) == before and a.sent > 0  # the fetch read from the peer
        except BaseException:
            os.killpg(serve.pid, signal.SIGKILL)  # serve and the server it runs (a SIGKILL is not passed on)
            serve.wait(10)
            raise
    got = streamload.load(store.url, device="cpu", peers=url)  # A is gone: the serve's seeder serves it
    assert_same(got, store.www / "model")
    assert sent(store) == before
    stop.touch()
    assert serve.wait(30) == 0, serve.stderr.read() if serve.stderr else ""
    assert _head(url, last, key) is None  # stopped with it
    assert_copies_exact(store, cache)


def test_serve_seed_is_checked_before_the_server_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from streamload.commands.cli import main

    ran = tmp_path / "ran"
    touch = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    assert main(["serve", "--seed", "8470", *touch]) == 1
    assert "--seed serves the complete copies kept in --cache-dir" in capsys.readouterr().err
    assert main(["serve", "--seed", "host:port", "--cache-dir", str(tmp_path / "c"), *touch]) == 1
    assert "'host:port' is not [HOST:]PORT" in capsys.readouterr().err
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        assert main(["serve", "--seed", f"127.0.0.1:{port}", "--cache-dir", str(tmp_path / "c"), *touch]) == 1
        assert f"cannot seed on 127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        taken.close()
    assert not ran.exists()


# -- the vLLM load format's "seed" ---------------------------------------------------------------------
def test_the_seed_option_is_checked() -> None:
    from streamload.integrations.vllm.options import check_options

    assert check_options({"seed": True, "cache_dir": "/c"})["seed"] == {}
    assert check_options({"seed": False})["seed"] is None
    assert check_options({"seed": "[::1]:0", "cache_dir": "/c"})["seed"] == {"host": "::1", "port": 0}
    assert check_options({"seed": {"port": 9000, "rate": "50MB", "connections": 4}, "cache_dir": "/c"})["seed"] == {
        "port": 9000, "rate": 50_000_000, "connections": 4}  # fmt: skip
    for bad, said in [({"seed": True}, "give cache_dir too"), ({"seed": 8470, "cache_dir": "/c"}, "must be a bool"),
                      ({"seed": {"prot": 1}, "cache_dir": "/c"}, "unknown keys prot"),
                      ({"seed": {"port": 70000}, "cache_dir": "/c"}, "must be a port number"),
                      ({"seed": {"rate": "fast"}, "cache_dir": "/c"}, "seed['rate']: 'fast' is not a size"),
                      ({"seed": "x:y", "cache_dir": "/c"}, "is not [HOST:]PORT")]:  # fmt: skip
        with pytest.raises(ValueError, match=r".*") as caught:
            check_options(bad)
        assert said in str(caught.value), (bad, str(caught.value))


def test_a_worker_seeds_from_before_its_load_until_its_model_is_freed(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What the loader runs before its first load where no fetch seeds for it (outside an engine: the only rank
    on its host): serving `cache_dir`, recorded by URL, until the model goes (or the load fails: what it returns
    stops it); a port in use: a warning, no seeding."""
    from streamload.integrations.vllm.seeding import start

    model = torch.nn.Linear(2, 2)
    caplog.set_level(logging.INFO, "vllm.streamload")
    url, _ = start({"seed": {"host": "127.0.0.1", "port": 0}, "cache_dir": str(store.seeded)}, model)
    assert url.startswith("http://127.0.0.1:") and any(url in r.getMessage() for r in caplog.records)
    before = sent(store)
    assert_same(streamload.load(store.url, device="cpu", peers=url), store.www / "model")
    assert sent(store) == before
    port = int(url.rsplit(":", 1)[1])
    assert start({"seed": {"host": "127.0.0.1", "port": port}, "cache_dir": str(store.seeded)}, model)[0] == ""
    assert [w for w in warnings_of(caplog) if f"127.0.0.1:{port}" in w and "does not seed" in w], warnings_of(caplog)
    assert start({"cache_dir": str(store.seeded)}, model)[0] == ""  # not asked
    path = url_path(ObjectPath(f"{store.url}model-00001-of-00003.safetensors"))
    key = read_key_of(f"{store.url}model-00001-of-00003.safetensors")
    assert _head(url, path, key) == 200
    del model
    gc.collect()
    assert _head(url, path, key) is None
    failed = torch.nn.Linear(2, 2)  # a load that fails: the loader stops the seeding at once
    url, stop = start({"seed": {"host": "127.0.0.1", "port": 0}, "cache_dir": str(store.seeded)}, failed)
    assert _head(url, path, key) == 200
    stop()
    assert _head(url, path, key) is None


def test_a_first_load_that_fails_after_compiling_stops_the_seeding() -> None:
    """With `overlap` the first load runs after vLLM compiles (deferred): where it fails, what seeds for it is
    stopped then, as for a load that fails at once."""
    from streamload.integrations.vllm.seeding import or_stop

    stopped: list[bool] = []

    def fails() -> None:
        raise OSError("the store went away")

    with pytest.raises(OSError, match="the store went away"):
        or_stop(lambda: stopped.append(True), fails)
    assert stopped == [True]
    or_stop(lambda: stopped.append(True), lambda: None)
    assert stopped == [True]


def test_a_worker_whose_fetch_seeds_serves_through_it_until_its_model_is_freed(store: Store, tmp_path: Path) -> None:
    """Where the engine's fetch seeds `cache_dir` from the engine's start (prefetch `seed`), the worker seeds
    no more itself: it reports the fetch's URL, and freeing the model ends the fetch and its seeding."""
    from streamload.integrations.startup import prefetch
    from streamload.integrations.vllm.seeding import start

    cache = tmp_path / "c"
    fetching = prefetch.start(store.url, tmp_path / "done.json", cache, seed={"host": "127.0.0.1", "port": 0})
    try:
        assert fetching.seeding and fetching.seeding.startswith("http://127.0.0.1:"), fetching.seeding
        report = prefetch.wait(fetching.done, fetching.pid, timeout=60)
        assert report["ok"] and not report["not_cached"], report
        started = {"host": socket.gethostname(), "pid": fetching.pid, "done": str(fetching.done),
                   "seeding": fetching.seeding}  # fmt: skip
        model = torch.nn.Linear(2, 2)
        options = {"seed": {"host": "127.0.0.1", "port": 0}, "cache_dir": str(cache)}
        assert start(options, model, started)[0] == fetching.seeding
        path = url_path(ObjectPath(f"{store.url}model-00002-of-00003.safetensors"))
        key = read_key_of(f"{store.url}model-00002-of-00003.safetensors")
        assert _head(fetching.seeding, path, key) == 200  # fetched, and serving on
        before = sent(store)
        assert_same(streamload.load(store.url, device="cpu", peers=fetching.seeding), store.www / "model")
        assert sent(store) == before
        del model
        gc.collect()
        assert _head(fetching.seeding, path, key) is None and not prefetch._alive(fetching.pid)
        assert start(options, torch.nn.Linear(2, 2), {**started, "seeding": ""})[0] == ""  # it could not: none
    finally:
        fetching.stop()
    assert_copies_exact(store, cache)


def test_a_worker_whose_fetch_has_ended_seeds_itself_and_no_other_fetch_is_stopped(
    store: Store, tmp_path: Path
) -> None:
    """A fetch that said where it seeds, then died (SIGKILL, the OOM killer): the worker seeds itself rather
    than report a URL nothing serves at. A fetch's record is matched to its process by its report's path too:
    stopping a fetch whose id another fetch holds now stops nothing."""
    from streamload.integrations.startup import prefetch
    from streamload.integrations.vllm.seeding import start

    seed = {"host": "127.0.0.1", "port": 0}
    first = prefetch.start(store.url, tmp_path / "a.json", tmp_path / "a", seed=seed)
    other = prefetch.start(store.url, tmp_path / "b.json", tmp_path / "b", seed=seed)
    try:
        taken = prefetch.Prefetch(other.pid, first.done)  # `first`'s record, were its id `other`'s now
        assert not taken.running() and other.running()
        taken.stop()
        assert other.running()
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while prefetch._alive(first.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        started = {"host": socket.gethostname(), "pid": first.pid, "done": str(first.done),
                   "seeding": first.seeding}  # fmt: skip
        model = torch.nn.Linear(2, 2)  # (held: its seeder serves while it lives)
        url, stop = start({"seed": seed, "cache_dir": str(tmp_path / "a")}, model, started)
        path = url_path(ObjectPath(f"{store.url}model-00001-of-00003.safetensors"))
        key = read_key_of(f"{store.url}model-00001-of-00003.safetensors")
        assert url and url != first.seeding and _head(url, path, key) is not None  # this process serves
        stop()
        assert _head(url, path, key) is None
    finally:
        first.stop()
        other.stop()
    assert not other.running()


def test_a_fetchs_warnings_come_with_its_report_into_the_engines_log(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up fetch runs in a process whose stderr is no one's: what it warns of (a peer that answers
    nothing, dropped) comes with its report, and the engine's first rank logs it once its load is done."""
    from streamload.integrations.startup import prefetch
    from streamload.integrations.vllm.startup import ahead

    refused = socket.create_server(("127.0.0.1", 0))
    down = f"http://127.0.0.1:{refused.getsockname()[1]}"
    refused.close()
    fetching = prefetch.start(store.url, tmp_path / "done.json", tmp_path / "c", peers=[down])
    report = prefetch.wait(fetching.done, fetching.pid, timeout=60)
    assert report["ok"] and [w for w in report["warnings"] if down in w and "dropped" in w], report
    ahead.said({"done": str(fetching.done)})
    logged = warnings_of(caplog)
    assert len(logged) == len(report["warnings"]) and any(down in w for w in logged), logged
    assert all(w.startswith("streamload: fetching while the engine started: peer ") for w in logged), logged


def test_a_fetch_whose_seeder_cannot_start_in_time_does_not_hold_the_engine_up(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch whose seeder is stuck before it binds (its token file a FIFO no one writes: a hung mount's
    like): the engine's start waits `SEED_START` for it, then goes on without seeding, one warning."""
    from streamload.integrations.startup import prefetch

    monkeypatch.setattr(prefetch, "SEED_START", 1.0)
    token = tmp_path / "token"
    os.mkfifo(token)
    began = time.monotonic()
    seed = {"host": "127.0.0.1", "port": 0, "token_file": str(token)}
    fetching = prefetch.start(store.url, tmp_path / "done.json", tmp_path / "c", seed=seed)
    try:
        assert fetching.seeding == "" and time.monotonic() - began < 10
        said = warnings_of(caplog)
        assert len(said) == 1 and "had not bound its seeder within 1 s" in said[0], said
    finally:
        fetching.stop()
    assert not fetching.running()


def test_load_with_peers_prints_what_the_peers_served(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.commands.cli import main

    with seeders(store.seeded) as (a,):
        assert main(["load", store.url, "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--peers", a.url]) == 0
        served = a.sent
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.startswith("peers:")), None)
    assert line is not None, out
    assert "served" in line and "source" in line and "%" in line and "nothing" not in line, line
    assert served > 0 and "(0%)" not in line, line
