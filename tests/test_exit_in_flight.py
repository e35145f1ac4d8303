"""A program that exits while loads from object storage are in flight (`storage/remote.py:_wind_down`).

obstore's requests are tasks on a Rust runtime that take the GIL once more when they end; a thread that
takes it while the interpreter finalizes is ended by `pthread_exit`, which cannot unwind Rust frames, and
the process aborted (SIGABRT, "terminate called without an active exception"): seen from the
`streamload prefetch` command, and from any program whose load ran in another thread at its exit. The
program here exits at several points of three loads from a slowed loopback store; each exit must be clean."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import RangeServer
from .test_cache import two_shards

pytest.importorskip("obstore")

PROGRAM = textwrap.dedent(
    """
    import sys, threading, time
    import torch  # noqa: F401 (imported first, as in a program: the loads start at once, not after torch's import)
    import streamload

    def load():
        try:
            for _ in streamload.iter(sys.argv[1]):
                pass
        except streamload.StreamloadError:  # a read refused as the process exits: said, and nothing more
            pass

    for _ in range(3):
        threading.Thread(target=load, daemon=True).start()
    time.sleep(float(sys.argv[2]))
    sys.exit(0)  # the loads are still reading
    """
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RangeServer]:
    s = RangeServer(two_shards(tmp_path_factory.mktemp("store")), rate=1 << 20)  # each load takes seconds
    yield s
    s.close()


@pytest.mark.parametrize("after", [0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7])
def test_a_program_that_exits_while_loads_read_ends_cleanly(server: RangeServer, tmp_path: Path, after: float) -> None:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    done = subprocess.run([sys.executable, str(program), f"{server.url}/model/", str(after)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, f"exited with {done.returncode}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr and "Fatal" not in done.stderr, done.stderr[-2000:]
