"""The compiled artifacts published beside the weights (`compiled.py`), fetched and installed on a
thread of their own while the first load reads the weights: vLLM compiles only after the load, and
finds them in its compile cache then. Off unless the user pins them (`compile_cache`): they run as code."""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any

from streamload.integrations.startup import pinned_digests, prefetch

log = logging.getLogger("vllm.streamload")


def start(options: dict[str, Any], model_config: Any) -> concurrent.futures.Future[str] | None:
    """The install under way (its result: what it did, in words), or None where nothing is pinned or
    nothing of ours can be published beside the model (a hub id)."""
    pinned = pinned_digests.pins(options.get("compile_cache"))
    if not pinned:  # off unless the user trusts an archive by its digest: it runs as code
        return None
    from streamload.integrations.vllm.startup import compiled

    source = str(options.get("source") or model_config.model)
    if "://" not in source and not os.path.isdir(source):
        return None  # a hub id: nothing of ours is published beside it

    started = options.get("prefetch")

    def install() -> str:
        try:
            staged = prefetch.staged_compile_caches(started) if isinstance(started, dict) else None
            return compiled.install(source, pinned, staged=staged)
        except pinned_digests.Refused as exc:  # nothing of it unpacked: vLLM compiles as it would have
            log.error("streamload: %s", exc)
            return str(exc)
        except Exception as exc:  # an optimisation only: vLLM compiles as it would have
            log.warning("streamload: compiled artifacts published beside %s not installed: %s", source, exc)
            return f"not installed: {exc}"

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamload-compiled")
    try:
        return pool.submit(install)
    finally:
        pool.shutdown(wait=False)
