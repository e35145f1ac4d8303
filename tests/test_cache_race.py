"""Two fetches into one cache directory, the one that writes SIGKILLed mid-write (`storage/cache.py`):
real processes (`python -m streamload.integrations.startup.prefetch`, and the `streamload prefetch` command a user
types)
from a loopback store capped per connection, the race run again and again. The survivor takes the
dead writer's place (it writes the copies itself), never aborts, and reports only what the cache
holds: every file under a copy's name is the store's, byte for byte.

STREAMLOAD_RACE_RUNS sets how many times the race is run (default 9, about 2 s each here)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .servers import RangeServer
from .test_cache import two_shards

pytest.importorskip("obstore")
RATE = 2 << 20  # bytes a second per connection: a fetch of the checkpoint takes about a second
DEADLINE = 60.0
RUNS = int(os.environ.get("STREAMLOAD_RACE_RUNS", "9"))
# Where the writer is killed: as soon as its partial files are there, once 10% or 80% of the bytes have
# left the store, or once its first copy is complete.
POINTS = ("start", "10%", "first-copy", "80%")


class Store(RangeServer):
    """A RangeServer that counts the bytes that have left (`sent` counts a response's bytes as it starts)."""

    def __init__(self, root: Path, rate: float) -> None:
        super().__init__(root, rate=rate)
        self.out = 0

    def _send(self, out: Any, data: bytes) -> None:
        step = 64 << 10
        for at in range(0, len(data), step):
            super()._send(out, data[at : at + step])
            with self._lock:
                self.out += min(step, len(data) - at)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_shards(tmp_path_factory.mktemp("store"))


@pytest.fixture
def server(store: Path) -> Iterator[Store]:
    s = Store(store, rate=RATE)
    yield s
    s.close()


def shards(store: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((store / "model").glob("*.safetensors"))}


def fetch(args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    """A fetch in a process of its own; faulthandler on, so that an abort leaves its threads' stacks."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip


def wait_until(what: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not what() and proc.poll() is None:
        assert time.monotonic() < deadline, "the point was not reached"
        time.sleep(0.002)


def partials(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.partial.*"))


def headers_read(server: RangeServer, names: Iterable[str]) -> bool:
    """Whether both fetches have read the header of every file (each reads it from the file's start):
    the next thing each does is to look at the cache, where one writes and the other waits."""
    starts = [
        p.rsplit("/", 1)[-1] for m, p, r in list(server.requests) if m == "GET" and r and r.startswith("bytes=0-")
    ]
    return all(starts.count(name) >= 2 for name in names)


def copies(cache: Path) -> dict[str, Path]:
    return {p.name: p for p in cache.rglob("*.safetensors")}


def race(server: Store, store: Path, tmp_path: Path, point: str, command: Callable[[int], list[str]]) -> tuple:
    """Two fetches started at once into one cache directory; the one that writes (told by the process
    id its partial files carry) SIGKILLed at `point`; the other's (index, exit status, stdout, stderr)."""
    cache = tmp_path / "cache"
    both = [fetch(command(i), tmp_path) for i in range(2)]
    try:
        wait_until(lambda: bool(partials(cache)), both[0])
        assert partials(cache), f"no fetch wrote: {both[0].communicate()[1].decode()}"
        pid = int(partials(cache)[0].name.split(".partial.", 1)[1].split(".")[-2])
        writer = next(p for p in both if p.pid == pid)
        survivor = next(p for p in both if p is not writer)
        wait_until(lambda: headers_read(server, shards(store)), survivor)
        total = sum(len(b) for b in shards(store).values())
        if point == "first-copy":
            wait_until(lambda: len(copies(cache)) >= 1, writer)
        elif point.endswith("%"):
            wait_until(lambda: server.out >= float(point[:-1]) / 100 * total, writer)
        writer.send_signal(signal.SIGKILL)
        writer.wait(DEADLINE)
        out, err = survivor.communicate(timeout=DEADLINE)
        return both.index(survivor), survivor.returncode, out.decode(), err.decode()
    finally:
        for p in both:
            if p.poll() is None:
                p.kill()
            p.communicate()


def assert_cache_holds_the_store(cache: Path, store: Path) -> None:
    """Every file complete under its copy's name, byte for byte the store's; nothing of the dead writer
    left (its partial files and locks went as the survivor took its place)."""
    held = copies(cache)
    for name, data in shards(store).items():
        assert name in held, f"no copy of {name} in the cache: {sorted(p.name for p in cache.rglob('*'))}"
        assert held[name].read_bytes() == data, name
    left = [p.name for p in cache.rglob("*") if p.is_file() and not p.name.endswith((".safetensors", ".json"))]
    assert left == [], left


@pytest.mark.parametrize("run", range(RUNS))
def test_the_survivor_of_a_killed_writer_writes_the_copies_and_reports_only_those(
    server: Store, store: Path, tmp_path: Path, run: int
) -> None:
    url, cache, point = f"{server.url}/model/", tmp_path / "cache", POINTS[run % len(POINTS)]
    command = lambda i: ["streamload.integrations.startup.prefetch", url, "--done", str(tmp_path / f"{i}.json"),  # noqa: E731
                         "--cache-dir", str(cache)]  # fmt: skip
    index, status, _, err = race(server, store, tmp_path, point, command)
    assert status == 0, f"the survivor ended with {status}: {err}"
    report = json.loads((tmp_path / f"{index}.json").read_text())
    assert report["ok"] is True, report
    held = {str(p): p.stat().st_size for p in copies(cache).values()}
    said = report.get("cached_bytes", report["bytes"])  # (what it fetched "into" the cache, without a list)
    assert said <= sum(held.values()), f"the survivor reports {said} bytes, the cache holds copies of {held}"
    assert set(report.get("cached", ())) <= set(held), f"the survivor reports copies the cache lacks: {report}"
    assert_cache_holds_the_store(cache, store)  # it took the dead writer's place
    assert "cached" in report, f"the survivor's report does not say what the cache holds: {report}"
    assert sorted(report["cached"]) == sorted(held) and report["not_cached"] == [], report
    assert report["cached_bytes"] == sum(len(b) for b in shards(store).values())


@pytest.mark.parametrize("point", ["first-copy", "10%"])
def test_the_prefetch_command_says_what_the_cache_holds_after_a_writer_was_killed(
    server: Store, store: Path, tmp_path: Path, point: str
) -> None:
    """As a user runs it: `streamload prefetch URL --cache-dir C` twice, the first killed mid-write."""
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    _, status, out, err = race(server, store, tmp_path, point, lambda i: ["streamload", "prefetch", url, "--cache-dir",
                                                                       str(cache)])  # fmt: skip
    assert status == 0, f"the survivor ended with {status}: {err}"
    said = re.search(r"into \S+: ([\d.]+) GB, (\d+) file\(s\) complete there", out)
    held = copies(cache)
    assert said is not None, f"{out!r}; the cache holds {sorted(held)}"
    assert_cache_holds_the_store(cache, store)
    assert int(said[2]) == len(held) == 2
    assert float(said[1]) == round(sum(p.stat().st_size for p in held.values()) / 1e9, 2)
