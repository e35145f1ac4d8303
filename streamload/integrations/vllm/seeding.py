"""Seeding (`"seed"` in `model_loader_extra_config`): the node serves `cache_dir` to other nodes' loads with
`peers=` (servers/seed.py) from the start of its load, what it has verified while it still loads, so that
engines started together split the checkpoint (storage/wave.py), and its complete copies once loaded.

Where the engine's fetch writes `cache_dir` (startup/ahead.py), that fetch seeds from the engine's start: the
first to read the store. Else the process that loads (vLLM's worker) seeds, from just before its load, on a
daemon thread. Either stops with that process, or when the model is freed (an engine closed in a process that
goes on). One seeder a host: the first rank on each host seeds (the others load into the same cache
directory). A port that cannot be bound, or a token, certificate or key file that cannot be used, costs the
node its seeding, not its engine: one warning.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from streamload.base import argument_checks

log = logging.getLogger("vllm.streamload")

FILES = ("token_file", "cert", "key")  # paths (str)
KEYS = ("host", "port", "rate", "connections", *FILES)  # the Seeder's arguments a "seed" dict may give


def seed_options(value: Any) -> dict[str, Any] | None:
    """The "seed" option as the Seeder's arguments (None: off): `true` (port 8470 on every address),
    `"[HOST:]PORT"`, or a dict of `KEYS` (`rate`: bytes a second, or with a unit: "50MB"; `token_file`,
    `cert`, `key`: paths, read where the seeder starts). Raises ValueError naming what is wrong."""
    from streamload.servers.seed import address

    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        host, port = address(value)
        return {"host": host, "port": port}
    if not isinstance(value, dict):
        raise ValueError(f"seed must be true, '[HOST:]PORT' or a dict of {', '.join(KEYS)}, not {value!r}")
    if unknown := sorted(set(value) - set(KEYS)):
        raise ValueError(f"seed: unknown keys {', '.join(unknown)}; known keys: {', '.join(KEYS)}")
    out = dict(value)
    if "host" in out and not isinstance(out["host"], str):
        raise ValueError(f"seed['host'] must be an address (a str), not {out['host']!r}")
    port = out.get("port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"seed['port'] must be a port number (0: any free one), not {port!r}")
    if "rate" in out:
        out["rate"] = argument_checks.size(out["rate"], "seed['rate']")
    if "connections" in out:
        out["connections"] = argument_checks.count(out["connections"], "seed['connections']")
    for name in FILES:
        if name in out and not (isinstance(out[name], str) and out[name]):
            raise ValueError(f"seed[{name!r}] must be a file's path (a str), not {out[name]!r}")
    return out


def start(options: dict[str, Any], model: Any, fetch: dict[str, Any] | None = None) -> tuple[str, Callable[[], Any]]:
    """Before the first load: seed `options["cache_dir"]` if the options ask and this is the first rank on its
    host, through `fetch` (the engine's fetch, "prefetch": `prefetch.ahead`'s dict) where that seeds. The URL
    served at ("" where it does not seed), and what stops the seeding (called for a load that failed; else
    with the model)."""
    spec = seed_options(options.get("seed"))
    if spec is None or _local_rank() != 0:
        return "", nothing
    from streamload.integrations.startup import prefetch

    url = prefetch.seeding_of(fetch) if fetch is not None else None
    if url is not None:  # it seeds since the engine started (or warned why it could not)
        return url, weakref.finalize(model, prefetch.stop_seeding, fetch) if url else nothing
    from streamload.servers.seed import Seeder, described

    folder = options["cache_dir"]  # checked with the options: seeding needs one
    try:
        seeder = Seeder(folder, **spec).start()
    except (OSError, ValueError) as exc:
        where = f"{spec.get('host', '0.0.0.0')}:{spec.get('port', 'the default port')}"  # nosec B104 # a message
        why = (exc.strerror if isinstance(exc, OSError) else None) or exc
        log.warning("streamload: cannot seed %s on %s (%s): this node serves its engine but does not seed",
                    folder, where, why)  # fmt: skip
        return "", nothing
    log.info("streamload: seeding %s at %s (to %s)", folder, seeder.url, described(seeder))
    return seeder.url, weakref.finalize(model, seeder.close)  # holds the seeder while the model lives


def nothing() -> None:
    """What stops no seeding."""


def or_stop(stop: Callable[[], Any], load: Callable[[], None]) -> None:
    """`load()`; where it fails, `stop()` first: a node whose first load failed seeds no more."""
    try:
        load()
    except BaseException:
        stop()
        raise


def _local_rank() -> int:
    """This rank's place on its host (0 outside an engine)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    from vllm.distributed import get_world_group

    return int(get_world_group().local_rank)
