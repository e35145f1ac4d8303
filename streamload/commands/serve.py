"""`streamload serve -- vllm serve ...`: a server's weights fetched from the moment its command starts.

The fetch starts first (`prefetch.ahead`: no torch, its first request out within a fraction of a
second; from `peers` first where given), then the server runs as a child process with the fetch named
in its environment, where streamload's vLLM load format adopts it; a server started without this prefix
fetches only once vLLM has imported itself and built its load config (seconds later). This process
stays to forward signals to the server and to clean up after it: the fetch and a private staging
directory end with it. With `seed`, the cache directory is served to other nodes (servers/seed.py) until
the server exits: by the fetch of a remote source from its start (what it has verified while it runs, so that
nodes started together split the checkpoint: storage/wave.py), else by this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess  # nosec B404 # runs the command the user typed, as an argv list, no shell
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamload.base.errors import StreamloadError
from streamload.integrations.startup import pinned_digests, prefetch

if TYPE_CHECKING:
    from streamload.servers.seed import Seeder

# Passed on to the server (a supervisor signals this process only). Not SIGINT: a terminal's Ctrl-C
# reaches the whole process group, the server included, and passed on it would be a second Ctrl-C.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def serve(
    command: Sequence[str],
    source: str | None = None,
    cache_dir: Path | None = None,
    compile_cache: str | Sequence[str] | None = None,
    peers: str | Sequence[str] | None = None,
    seed: str | None = None,
    seeding: dict[str, Any] | None = None,
) -> int:
    """Run `command` with its weights (`source`, else found in its arguments) fetched from now on;
    its exit status (128 + the signal's number where a signal ended it). `compile_cache`: the pinned
    digests of compiled-artifact archives to fetch first (else the command's "compile_cache" option;
    `pinned_digests.py`). `peers`: nodes seeding the weights, read from first (else the command's "peers" option;
    storage/peers.py). `seed`: `[HOST:]PORT` to serve the cache directory at from the fetch's start until the
    command exits; `seeding`: the Seeder's `token_file`, `cert`, `key`."""
    if not command:
        raise ValueError(
            "streamload serve: give the server's command after --, e.g. streamload serve -- vllm serve MODEL"
        )
    source, cache_dir, extra = _weights(command, source, cache_dir)
    pinned = list(compile_cache) if compile_cache else extra.get("compile_cache")
    pinned_digests.pins(pinned)  # a bad pin fails here, in one line, before the server starts
    peers = peers or extra.get("peers")  # type: ignore[assignment]
    remote = source is not None and "://" in source
    # a port in use (or a certificate that cannot be used) fails before the server starts: bound now, here or
    # by the fetch, which seeds a remote source's copies from its start
    spec = _seed_spec(seed, cache_dir, seeding or {}) if seed else None
    seeder = _seeder(seed, cache_dir, spec) if spec is not None and not remote else None
    try:
        if source is None:
            print("streamload serve: no weights to fetch ahead found in the command (pass --source); running it "
                  "as it is", file=sys.stderr)  # fmt: skip
        elif not remote and not os.path.exists(source):
            raise ValueError(f"streamload serve: {source}: no such file or directory, nor a URL")
        else:  # cleaned up at this process's exit (atexit)
            fetching = prefetch.ahead(source, cache_dir, pinned, peers, spec if remote else None)
            if remote and spec is not None:
                if not fetching["seeding"]:
                    raise StreamloadError(f"streamload serve: cannot seed on {seed} (the warning above says why)")
                print(f"streamload serve: seeding {cache_dir} at {fetching['seeding']} from the fetch's start: what "
                      "it has verified, then its complete copies", file=sys.stderr, flush=True)  # fmt: skip
        try:
            child = subprocess.Popen(list(command))  # nosec B603 # the user's own command line (streamload serve -- ...)
        except OSError as exc:
            raise StreamloadError(f"streamload serve: cannot run {command[0]!r}: {exc.strerror or exc}") from None
        # (send_signal passes over a server that has exited already)
        previous = {sig: signal.signal(sig, lambda sig, _: child.send_signal(sig)) for sig in FORWARDED}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server has it: wait for it
        try:
            status = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 128 - status if status < 0 else status
    finally:
        if seeder is not None:
            seeder.close()


def _seed_spec(seed: str, cache_dir: Path | None, options: dict[str, Any]) -> dict[str, Any]:
    """The Seeder's arguments for `--seed` (`[HOST:]PORT`) and `options`. Raises ValueError naming what is
    wrong (no cache directory, an address that is not one)."""
    from streamload.servers.seed import address

    if cache_dir is None:
        raise ValueError("streamload serve: --seed serves the complete copies kept in --cache-dir: give --cache-dir "
                         "(a private staging directory is removed once the engine has loaded)")  # fmt: skip
    host, port = address(seed)
    return {"host": host, "port": port, **{k: str(v) for k, v in options.items() if v is not None}}


def _seeder(seed: str, cache_dir: Path | None, spec: dict[str, Any]) -> Seeder:
    """The seeder of `cache_dir` (a local source's: no fetch writes it), serving. Raises StreamloadError where
    its port cannot be bound, ValueError naming a token, certificate or key file that cannot be used."""
    from streamload.servers.seed import Seeder, described

    assert cache_dir is not None  # (`_seed_spec` says so)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    try:
        seeder = Seeder(cache_dir, **spec).start()
    except OSError as exc:
        raise StreamloadError(f"streamload serve: cannot seed on {seed}: {exc.strerror or exc}") from None
    print(f"streamload serve: seeding the complete copies in {cache_dir} at {seeder.url} (to {described(seeder)})",
          file=sys.stderr, flush=True)  # fmt: skip
    return seeder


def _weights(
    command: Sequence[str], source: str | None, cache_dir: Path | None
) -> tuple[str | None, Path | None, dict[str, object]]:
    """The weights' source and cache directory: as given, else from vLLM's arguments in `command`
    (`--model-loader-extra-config` JSON: "source", "cache_dir"; else the model: `serve MODEL`,
    `--model`); and that JSON."""
    args = list(command)
    extra: dict[str, object] = {}
    model = None
    for i, arg in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("--model-loader-extra-config"):
            text = arg.split("=", 1)[1] if "=" in arg else value
            try:
                extra = dict(json.loads(text or ""))
            except (ValueError, TypeError):
                raise ValueError(
                    f"streamload serve: --model-loader-extra-config is not a JSON object: {text!r}"
                ) from None
        elif arg == "--model" or arg.startswith("--model="):
            model = arg.split("=", 1)[1] if "=" in arg else value
        elif arg == "serve" and model is None and value is not None and not value.startswith("-"):
            model = value
    if cache_dir is None and extra.get("cache_dir"):
        cache_dir = Path(str(extra["cache_dir"]))
    if source or extra.get("source"):
        return str(source or extra["source"]), cache_dir, extra
    if model is not None and ("://" in model or os.path.exists(model)):
        return model, cache_dir, extra
    return None, cache_dir, extra  # a hub id: vLLM downloads it itself
