"""The weights on their way while the engine starts: fetching begins where vLLM builds the engine's
load config (in the process that starts the engine), seconds before the loader is called.

vLLM calls a loader only after it has imported itself, spawned its engine and worker processes and
built the model; fetching from then on makes a server's start-up the sum of the two. So the
`create_load_config` hook (config_hook.py) adopts the fetch the process began before importing vLLM
(`prefetch.ahead`, `streamload serve`), else starts `streamload.integrations.startup.prefetch` in a
child process: local files are read into the page cache; weights in object storage are written into
`cache_dir`, or, without one, into a private staging directory on local disk, file after file. The
loader, in each worker, reads each file as soon as the fetch has completed it (no byte is downloaded
twice, and the tail after the last byte is one file's read).

Host memory: none held (the page cache's, and only where the checkpoint fits half the memory
available); disk: the checkpoint's size in the staging directory until the load ends. The private
staging directory is made in the system's temporary directory (where that is a tmpfs, the staged
checkpoint is memory: give `cache_dir` on a disk there). It is removed by the engine's first rank on
its host once every rank has loaded; other hosts' staging (several nodes, each starting its own engine
process) and the prefetch end with the process that made them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamload.integrations.startup import prefetch
from streamload.integrations.vllm.ranks import Ranks
from streamload.integrations.vllm.report import last_load
from streamload.storage import redacted

if TYPE_CHECKING:
    from streamload.integrations.vllm.state import LoadState

log = logging.getLogger("vllm.streamload")


def start_fetch(model: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """The fetch of the weights of `model` (or `options["source"]`) under way, adopted or started now:
    what the loader needs to find them (a plain dict: vLLM sends the load config to its workers), or
    None where there is nothing to fetch ahead (a hub id, which vLLM downloads in a worker)."""
    source = str(options.get("source") or model)
    remote = "://" in source
    if options.get("prefetch") is False or not (remote or os.path.exists(source)):
        return None
    adopted = prefetch.adopt(source)
    if adopted is not None:
        if options.get("cache_dir") and adopted.get("cache_dir") != str(options["cache_dir"]):
            log.warning("streamload: the fetch under way writes into %s, not cache_dir %s: reading from there",
                        adopted.get("cache_dir"), options["cache_dir"])  # fmt: skip
        log.info("streamload: the weights have been fetched since the process started (%s)", redacted(source))
        return adopted
    try:
        return prefetch.ahead(source, options.get("cache_dir"), options.get("compile_cache"), options.get("peers"),
                              options.get("seed"))  # fmt: skip
    except Exception as exc:  # an optimisation only: the loader reads the weights itself
        log.warning("streamload: could not start fetching %s while the engine starts: %s", source, exc)
        return None


def _staging_dir(ahead: dict[str, Any]) -> str | None:
    """In a worker, before the first load: the cache directory to load from, or None (fetched into the
    page cache, or not here). The load waits for each file's writer in the cache, and reads a file
    itself if the fetch ends without it."""
    if ahead.get("cache_dir") is None or ahead.get("host") != socket.gethostname():
        return None
    try:  # ended already without the weights (over its budget, say): only a cache of the user's is used
        report = json.loads(Path(ahead["done"]).read_text())
    except (OSError, ValueError):
        report = None
    if report is not None and not report.get("ok"):
        log.warning("streamload: fetching the weights while the engine started did not finish: %s", report["error"])
        return None if ahead.get("owned") else ahead["cache_dir"]
    log.info("streamload: loading the weights as they are fetched into %s", ahead["cache_dir"])
    return str(ahead["cache_dir"])


def load_from_staging(state: LoadState, started: Any, load: Callable[..., None], *args: Any) -> None:
    """`load(*args)` (the loader's first load) from the files the fetch `started` with the engine stages
    (the load config's "prefetch": a dict where one started), if any; then a private staging directory
    is removed once no rank of the engine reads it."""
    fetched = started if isinstance(started, dict) else None
    staged = _staging_dir(fetched) if fetched is not None else None
    options = state.options
    last_load.staged = staged or ""
    if staged is not None:
        state.options = {**options, "cache_dir": staged}
    try:
        load(*args)
    finally:
        state.options = options
        # Every rank joins the barrier, after a failed load too and with a fetch or without: on several
        # nodes each node's engine process starts its own fetch, and one whose fetch could not start
        # must not leave the others waiting for it.
        ranks = Ranks.of_engine()
        ranks.barrier()
        if fetched and ranks.rank == 0 and fetched.get("host") == socket.gethostname():
            said(fetched)
            if fetched.get("owned"):
                shutil.rmtree(fetched["cache_dir"], ignore_errors=True)


def said(fetched: dict[str, Any]) -> None:
    """The warnings of the fetch `fetched` (its process has no log of its own: they came with its report),
    once, in this process's log."""
    try:
        report = json.loads(Path(fetched["done"]).read_text())
    except (OSError, ValueError, KeyError):
        return
    for line in report.get("warnings", []) if isinstance(report, dict) else []:
        log.warning("streamload: fetching while the engine started: %s", str(line).removeprefix("streamload: "))


def starts_engine(engine_args: Any) -> bool:
    """Whether the process building this load config starts the engine: not one of the API-server
    processes `vllm serve --api-server-count N` starts (each builds its config again, and the engine
    gets the one the first process built, which the fetch it started is in)."""
    count, rank = getattr(engine_args, "_api_process_count", 1), getattr(engine_args, "_api_process_rank", 0)
    return not (count > 1 and rank >= 0)
