"""The weights on their way while the engine starts: fetching begins where vLLM builds the engine's
load config (in the process that starts the engine), seconds before the loader is called.

vLLM calls a loader only after it has imported itself, spawned its engine and worker processes and
built the model; fetching from then on makes a server's start-up the sum of the two. So the
`create_load_config` hook starts `streamload.prefetch` in a child process: local files are read into
the page cache; weights in object storage (`source` or an object-storage model) are written into
`cache_dir`, or, without one, into a private staging directory on local disk. The loader, in each
worker, waits for an object-storage prefetch to end (so no byte is downloaded twice) and reads the
staged files; it does not wait for the page cache. A private staging directory is removed once
every rank has loaded, and with the process that made it; the prefetch ends with that process.

Host memory: none held (the page cache's, and only where the checkpoint fits half the memory
available); disk: the checkpoint's size in the staging directory until the load ends. The private
staging directory is made in the system's temporary directory: where that is a tmpfs, the staged
checkpoint is memory; give `cache_dir` on a disk there. It is removed by the engine's first rank on
its host; other hosts' staging (several nodes, each starting its own engine process) goes when that
process exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamload import prefetch

log = logging.getLogger("vllm.streamload")


def begin(model: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """Start fetching the weights of `model` (or `options["source"]`); what the loader needs to find
    them (a plain dict: vLLM sends the load config to its workers), or None where there is nothing
    to fetch ahead (a hub id, which vLLM downloads in a worker; `prefetch: false`)."""
    source = str(options.get("source") or model)
    remote = "://" in source
    if options.get("prefetch") is False or not (remote or os.path.exists(source)):
        return None
    try:
        work = Path(tempfile.mkdtemp(prefix="streamload-prefetch-"))
        staging: Path | None = None
        if remote:
            staging = Path(options["cache_dir"]) if options.get("cache_dir") else work / "staged"
            staging.mkdir(parents=True, exist_ok=True)
        fetching = prefetch.start(source, work / "done.json", staging)
    except Exception as exc:  # an optimisation only: the loader reads the weights itself
        log.warning("streamload: could not start fetching %s while the engine starts: %s", source, exc)
        return None

    def clean_up() -> None:  # the process that started the engine is ending
        fetching.stop()
        shutil.rmtree(work, ignore_errors=True)

    atexit.register(clean_up)
    return {
        "host": socket.gethostname(),
        "pid": fetching.pid,
        "done": str(work / "done.json"),
        "cache_dir": str(staging) if staging is not None else None,
        "owned": staging is not None and not options.get("cache_dir"),
    }


def staged(ahead: dict[str, Any]) -> str | None:
    """In a worker, before the first load: the cache directory to load from (after waiting for the
    prefetch to end), or None (fetched into the page cache, or not here: the load reads the source)."""
    if ahead.get("cache_dir") is None or ahead.get("host") != socket.gethostname():
        return None
    log.info("streamload: waiting for the weights being fetched since the engine started (into %s)", ahead["cache_dir"])
    report = prefetch.wait(Path(ahead["done"]), int(ahead["pid"]))
    if not report.get("ok"):
        log.warning("streamload: fetching the weights while the engine started did not finish: %s", report["error"])
        return None if ahead.get("owned") else ahead["cache_dir"]
    return str(ahead["cache_dir"])


def loaded(ahead: dict[str, Any], rank: int, everyone: Callable[[], None]) -> None:
    """After the first load, on every rank of the engine (`everyone()`: a barrier of them all): a
    private staging directory is removed once no rank reads it."""
    if not ahead.get("owned"):
        return
    everyone()  # every rank, wherever it runs: the same options on all of them
    if rank == 0 and ahead.get("host") == socket.gethostname():
        shutil.rmtree(ahead["cache_dir"], ignore_errors=True)
