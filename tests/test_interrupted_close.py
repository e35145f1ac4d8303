"""Ctrl-C while a stream closes: the close still waits for the reads in flight, releases everything, and
no descriptor or staging slot of it goes to a later stream while a read may still use it.

The first stream's reads are slowed (the posix reader's `os.preadv`, wrapped), so that reads are in flight
when the loop is left; SIGINT is sent to the main thread at a point of the close (while it waits for those
reads, while it closes the descriptors, while it gives the staging slots back) or while the consumer waits
for a batch, once or twice.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
import streamload.read.posix
from streamload.device.base import HostRing
from streamload.read.pool import ReaderPool
from streamload.storage import LocalFiles

from .conftest import open_fds, same_bits

SLOW = 0.4  # seconds a read of the first file waits before it reads
RING = {"ring_bytes": 64 * 1024, "slots": 2, "chunk_bytes": 16 * 1024, "threads": 4}  # 2 tensors a batch


def _checkpoint(path: Path, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    save_file({f"layers.{i}.w": torch.randn(64, 64, generator=g) for i in range(16)}, path)
    return path


class SlowOs:
    """`os` for the posix reader: a read of one of `delays`' files waits before it reads (the file named by
    its descriptor when the read begins), and a read of `first` then also until `hold` is set (however
    slowly the machine runs, it is in flight until then); it counts the reads of `first` in flight and
    their errors."""

    def __init__(self, first: Path, delays: dict[Path, float], hold: threading.Event) -> None:
        self.first = os.path.realpath(first)
        self.delays = {os.path.realpath(p): d for p, d in delays.items()}
        self.hold = hold
        self.lock = threading.Lock()
        self.in_flight = 0  # reads of `first` begun and not returned
        self.errors: list[BaseException] = []

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        mine = path == self.first
        if mine:
            with self.lock:
                self.in_flight += 1
        try:
            time.sleep(self.delays.get(path, 0.0))
            if mine:
                self.hold.wait(10.0)
            return os.preadv(fd, buffers, offset)  # a late read on a descriptor closed (or reused) meanwhile
        except BaseException as exc:
            if mine:
                self.errors.append(exc)
            raise
        finally:
            if mine:
                with self.lock:
                    self.in_flight -= 1

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)


class Interrupts:
    """SIGINT to the main thread, `times` times, `gap` apart, from a thread of its own; only while armed (a
    signal that the code under test let through early must not reach pytest). Signals that come while
    disarmed are counted, not raised. `done` is clear while signals are due."""

    def __init__(self) -> None:
        self.armed = False
        self.sent = self.late = 0
        self.done = threading.Event()
        self.done.set()
        self._threads: list[threading.Thread] = []
        self._previous = signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if not self.armed:
            self.late += 1
            return
        raise KeyboardInterrupt

    def send(self, times: int, delay: float, gap: float = 0.05) -> None:
        self.done.clear()

        def run() -> None:
            try:
                time.sleep(delay)
                for k in range(times):
                    if k:
                        time.sleep(gap)
                    if not self.armed:
                        return
                    self.sent += 1
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            finally:
                self.done.set()

        thread = threading.Thread(target=run, name="test-interrupts")
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self.armed = False
        for thread in self._threads:
            thread.join()
        signal.signal(signal.SIGINT, self._previous)


@pytest.fixture
def interrupts() -> Iterator[Interrupts]:
    sigint = Interrupts()
    try:
        yield sigint
    finally:
        sigint.close()


def _at(
    monkeypatch: pytest.MonkeyPatch, cls: type, name: str, ours: Callable[[Any], bool], then: Callable[[], None]
) -> None:
    """Run `then` when `cls.name` is called on one of the first stream's objects (`ours`), before the call."""
    real = getattr(cls, name)

    def wrapper(self: Any, *args: Any) -> Any:
        if ours(self):
            then()
        return real(self, *args)

    monkeypatch.setattr(cls, name, wrapper)


def _made(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[Any]:
    """The instances of `cls` made from now on, in order."""
    made: list[Any] = []
    real = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", init)
    return made


# The remote storage's event loop thread lives as long as the process once a remote load ran (earlier
# tests in the suite): not a stream's
_PROCESS_WIDE = ("streamload-objects",)


def _streamload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streamload") and t.name not in _PROCESS_WIDE]


def _eventually(check: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# (where, times): the point of the close where SIGINT comes, and how many
CASES = [
    ("waiting for reads", 1),
    ("closing descriptors", 1),
    ("giving slots back", 1),
    ("waiting for a batch", 1),
    ("waiting for reads", 2),
    ("closing descriptors", 2),
    ("giving slots back", 2),
    ("waiting for a batch", 2),
]


@pytest.mark.parametrize(("point", "times"), CASES)
def test_a_close_interrupted_waits_for_its_reads_and_releases_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupts: Interrupts, point: str, times: int
) -> None:
    first, second = _checkpoint(tmp_path / "a.safetensors", 1), _checkpoint(tmp_path / "b.safetensors", 2)
    want = load_file(second)
    if point == "waiting for a batch":
        interrupts.done.clear()  # the first stream's reads last until the signals were sent
    slow = SlowOs(first, {first: SLOW, second: 0.05}, interrupts.done)  # the second's: they overlap late ones
    monkeypatch.setattr(streamload.read.posix, "os", slow)
    fds, before = open_fds(), streamload.usage()
    assert before.streams == 0 and not _streamload_threads()

    # Where each of the first stream's releases happened, and how many of its reads were in flight then
    released: dict[str, int] = {}
    pools, rings = _made(monkeypatch, ReaderPool), _made(monkeypatch, HostRing)  # the first: the first stream's

    def note(what: str, pause: float) -> Callable[[], None]:
        def then() -> None:
            released.setdefault(what, slow.in_flight)
            if point == what:
                interrupts.send(times, delay=pause)
                if what != "waiting for reads":
                    interrupts.done.wait(10.0)  # the signals come while this step runs

        return then

    _at(monkeypatch, ReaderPool, "close", lambda p: p is pools[0], note("waiting for reads", 0.05))
    _at(monkeypatch, LocalFiles, "close", lambda f: _holds(f, first), note("closing descriptors", 0.0))
    _at(monkeypatch, HostRing, "close", lambda r: r is rings[0], note("giving slots back", 0.0))

    interrupts.armed = True
    with pytest.raises(KeyboardInterrupt):
        try:
            with streamload.iter(first, device="cpu", reader="posix", **RING) as stream:
                if point == "waiting for a batch":
                    interrupts.send(times, delay=SLOW / 4)
                for _ in stream:
                    if point == "waiting for reads":
                        interrupts.done.clear()  # the next batches' reads last until the signals were sent
                    _eventually(lambda: slow.in_flight > 0, "the next batches' reads begin")  # the loop is left
                    break  # while they run
        finally:
            interrupts.armed = False
    reads, streams, threads = slow.in_flight, streamload.usage().streams, _streamload_threads()
    leaked = open_fds() - fds

    # The next stream, over another file, gets exactly its own bytes (it starts while a close given up on
    # after a second Ctrl-C may still wait for reads). A slow consumer: its filled slots wait for it.
    got = {}
    with streamload.iter(second, device="cpu", reader="posix", **RING) as stream:
        for name, tensor in stream:
            got[name] = tensor
            time.sleep(0.02)
    assert got.keys() == want.keys()
    assert [n for n, t in want.items() if not same_bits(got[n], t)] == []

    assert interrupts.sent == times and interrupts.late == 0  # each came while the close ran
    if times == 1:  # the close waited for every read, and released everything before it raised
        assert reads == 0 and streams == 0 and threads == [] and not leaked
    _eventually(lambda: streamload.usage().streams == 0 and not _streamload_threads(), "the reader threads end")
    assert slow.in_flight == 0 and slow.errors == []  # no late read met a closed descriptor
    assert released.keys() == {"waiting for reads", "closing descriptors", "giving slots back"}
    assert released["closing descriptors"] == released["giving slots back"] == 0  # no read of it ran then
    assert open_fds() <= fds
    after = streamload.usage()
    assert after.staging_bytes == 0 and after.streams == 0


def _holds(files: LocalFiles, path: Path) -> bool:
    try:
        files.fd(path)
    except KeyError:
        return False
    return True


def test_an_error_while_releasing_reaches_the_caller_after_the_rest_was_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release runs on a thread of its own on the main thread: what fails there is still the caller's."""
    path = _checkpoint(tmp_path / "a.safetensors", 1)
    fds = open_fds()

    def fail(self: LocalFiles) -> None:
        real_close(self)
        raise OSError("closing failed")

    real_close = LocalFiles.close
    monkeypatch.setattr(LocalFiles, "close", fail)
    with pytest.raises(OSError, match="closing failed"):
        with streamload.iter(path, device="cpu", reader="posix", **RING) as stream:
            next(stream)
    assert open_fds() <= fds and not _streamload_threads()
    assert streamload.usage().streams == 0 and streamload.usage().staging_bytes == 0
