"""The load format's options (`model_loader_extra_config`): the declared table and its checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamload import options
from streamload.integrations.startup import pinned_digests
from streamload.integrations.vllm.seeding import seed_options
from streamload.storage.remote import is_url

FORMAT = "streamload"  # the load format's name: `load_format="streamload"`

# model_loader_extra_config keys: streamload.iter's, as it declares those a JSON config carries
# (`streamload.options.CONFIG`: the tuning, cache_dir, verify), where the weights are, and the switches.
OPTIONS: dict[str, type | tuple[type, ...]] = {
    **{name: options.CONFIG[name] for name in ("reader", "threads", "ring_bytes", "slots", "chunk_bytes", "cache_dir")},
    "source": str,  # weights from here (a directory, s3://, http(s)://) while configs come from `model`
    # dry run + rank-local reads straight into the parameters (default: where it pays, direct.dry_run_worth_it)
    "direct": bool,
    "cooperative": bool,  # tensor-parallel ranks divide what several of them read whole (default False)
    "verify": options.CONFIG["verify"],
    # fetch while the engine starts (default true; the engine fills in a dict, startup/ahead.py)
    "prefetch": (bool, dict),
    # install the compiled artifacts published beside the weights whose digests are pinned: "sha256:<hex>"
    # or a list of them (default off: they run as code; startup/compiled.py, integrations/startup/pinned_digests.py)
    "compile_cache": (bool, str, list),
    "overlap": bool,  # compile and warm up while the weights arrive, then load them in place (startup/overlap.py)
    "peers": options.CONFIG["peers"],  # nodes seeding the weights, read from first (storage/peers.py)
    # once loaded, serve cache_dir's complete copies to other nodes' peers= (seeding.py): true, "[HOST:]PORT"
    # or {"host", "port", "rate", "connections"}
    "seed": (bool, str, dict),
}
assert OPTIONS.keys() >= options.CONFIG.keys()  # every option a config carries to iter (in the order users know)
STREAM = tuple(options.CONFIG)  # handed to iter as they are


def check_options(extra: Any) -> dict[str, Any]:
    """`model_loader_extra_config`, checked: known keys with values of the right type. None (vLLM's own
    default, which its loaders take) is no options."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(
            f"model_loader_extra_config for load format {FORMAT!r} must be a dict, not {type(extra).__name__}"
        )
    if unknown := sorted(set(extra) - set(OPTIONS)):
        raise ValueError(
            f"unknown model_loader_extra_config keys for load format {FORMAT!r}: {', '.join(unknown)}; "
            f"known keys: {', '.join(OPTIONS)}"
        )
    checked = dict(extra)
    for key, value in extra.items():
        want = OPTIONS[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            kinds = [want] if isinstance(want, type) else list(want)
            kind = " or ".join(("an " if t.__name__[0] in "aeiou" else "a ") + t.__name__ for t in kinds)
            raise ValueError(f"model_loader_extra_config[{key!r}] must be {kind}, not {value!r}")
        try:  # as streamload.iter checks them (sizes with units made bytes), and the pins
            if key in options.CONFIG:
                checked[key] = options.check(key, value)
            elif key == "compile_cache":
                pinned_digests.pins(value)
            elif key == "seed":
                checked[key] = seed_options(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model_loader_extra_config: {exc}") from None
    if checked.get("seed") is not None and not checked.get("cache_dir"):
        raise ValueError("model_loader_extra_config['seed'] serves the complete copies a load keeps in cache_dir: "
                         "give cache_dir too")  # fmt: skip
    source = extra.get("source")
    if source is not None and not is_url(source) and not Path(source).exists():  # not a minute later, in a worker
        raise ValueError(f"model_loader_extra_config['source']: {source}: no such file or directory")
    return checked
