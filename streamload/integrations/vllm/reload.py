"""In-place reloads (`StreamloadModelLoader.get_all_weights`): the stream vLLM's `reload_weights` feeds
`load_weights`, and, where a reload fails on any rank, the weights served before put back on every one.

vLLM's in-place reload (`reload_weights(weights_path=...)`, the weight-transfer engine's updates)
empties each layer onto meta, and fills and processes it as its weights arrive, in place. A stream
that fails mid-way (a damaged byte caught by `verify`, a shard gone or cut short, a store refusing)
would leave the layers already filled with the new weights and the others on meta: a dead engine.
So the reload's feed ends, on every rank, with a vote (`ranks.Ranks.decide`: one all-reduce on vLLM's
CPU world group: every pipeline stage and every tensor, expert and data parallel rank, since a stage
that kept new weights while another put old ones back would serve a mix); where any rank failed,
every rank puts its layers back (vLLM's own finalisation), reads the weights it served before over
them if anything had arrived (only from the very files read then: restore.py), and raises the error.
Every parameter keeps its storage, so the engine serves the previous weights at the same addresses.

The error is raised by the engine's last rank only, naming every rank's reason (the others log
it and return, their weights restored): vLLM's executor reads the workers' replies to a call in rank
order and stops at the first failure, leaving the later replies queued as the answers to the next
call (vLLM 0.32, `MultiprocExecutor.collective_rpc`), so a failure raised by every rank, or by a
rank before the last, would make the engine's next call fail with a stale error. A rank whose vote
was lost (a peer died or hung: ranks.py) asks its peers nothing more: it puts its layers back, reads
the previous weights over them, and raises (every such rank: the engine has lost a worker, so the
rank-order reasoning above no longer holds).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from copy import copy as shallow_copy
from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.config import ModelConfig

from streamload.errors import StreamloadError

from . import restore
from .direct import PREDICTED
from .feed import feed
from .files import Part, checkpoints, shapes
from .ranks import Decision, Ranks, tp_group, tp_rank_world
from .report import record

if TYPE_CHECKING:
    from .loader import StreamloadModelLoader

log = logging.getLogger("vllm.streamload")


def guarded(
    loader: StreamloadModelLoader, model_config: ModelConfig, model: nn.Module
) -> Generator[tuple[str, torch.Tensor]]:
    """The reload's stream (`stream`), then the vote of every rank; where any failed, this rank's
    previous weights put back and the error raised (by the last rank, or every rank that lost the vote)."""
    world = tp_rank_world()[1]
    failure: Exception | None = None
    touched = False
    try:  # vLLM's reload has emptied the layers: from here every rank votes, whatever happens
        for pair in stream(loader, model_config, model, world, bool(loader.options.get("cooperative"))):
            touched = True
            yield pair
    except Exception as exc:  # the stream's error (or the headers')
        failure = exc
    ranks = Ranks.of_engine()
    decided = ranks.decide(None if failure is None else str(failure), touched)  # never raises
    if decided.ok:
        restore.SERVED[model] = loader._served(model_config, loader._reloaded)
        return
    previous = restore.SERVED.get(model)
    why = failure or StreamloadError(decided.lost or "another rank of the engine failed")
    wanted = getattr(loader, "_where", None) or model_config.model
    _restore(loader, previous, decided.touched, model_config, model, f"reloading from {wanted} failed ({why})")
    served = previous.where if previous is not None else "the weights it had"
    message = f"reloading from {wanted} failed; serving {served} again: {_because(ranks, decided, why)}"
    if not ranks.last and not decided.lost:  # the last rank raises it (the module's docstring: why only one)
        log.error("streamload: %s", message)
        return
    raise StreamloadError(message) from why


def stream(
    loader: StreamloadModelLoader,
    model_config: ModelConfig,
    model: nn.Module,
    world: int,
    cooperative: bool,
    parts: list[Part] | None = None,
) -> Generator[tuple[str, torch.Tensor]]:
    """(name, tensor) in layer order, as vLLM's `reload_weights` feeds `load_weights`: where the first
    load's prediction (`direct.PREDICTED`) holds for these tensors, each rank's part only, full-shaped;
    otherwise whole tensors."""
    parts = parts if parts is not None else loader._parts(model_config, model, first=False)
    loader._reloaded, loader._stats = parts, []
    options = loader._stream_options(model)
    predicted = PREDICTED.get(model)
    learned = predicted.learned(shapes(parts)) if predicted is not None else None
    if cooperative and world > 1:
        if not Ranks.of_tensor_parallel().all(learned is not None):
            learned = None
        options["cooperative"] = tp_group(options["device"])
    weights = (
        feed(parts, options, loader._stats, learned, full_shaped=True)
        if learned
        else feed(parts, options, loader._stats)
    )
    try:
        yield from weights
    finally:
        weights.close()
    record(parts, loader._stats, learned, world)


def _restore(
    loader: StreamloadModelLoader,
    previous: restore.Served | None,
    touched: bool,
    model_config: ModelConfig,
    model: nn.Module,
    failed: str,
) -> None:
    """This rank's layers put back and, where new weights reached any (or may have), the previous
    weights read over them; `failed`: what the error says went wrong before."""
    try:
        restore.put_back_layers(model, model_config)
        if touched:  # new weights reached some layer on some rank: the previous ones are read again
            if previous is None:
                raise StreamloadError("no earlier load of this model by streamload is known to read again")
            _read_again(loader, previous, model_config, model)
    except Exception as again:
        raise StreamloadError(
            f"{failed}, and so did restoring {previous.where if previous else 'the weights served before'} "
            f"({again}): this worker's weights are a mix; restart it"
        ) from again
    finally:
        if previous is not None:
            previous.put_back(model_config)


def _read_again(
    loader: StreamloadModelLoader, previous: restore.Served, model_config: ModelConfig, model: nn.Module
) -> None:
    """The weights `previous` names, read over the model in place (each rank alone, unchecked: they
    were checked when they were first read), from the very files read then: where any changed since
    (restore.py: `Loaded`), nothing is read and the error names each file and what changed."""
    again = type(loader)(loader.load_config)
    again.options = {k: v for k, v in loader.options.items() if k not in ("cooperative", "verify")}
    config = shallow_copy(model_config)
    config.model, config.revision = previous.where, None
    if hasattr(config, "model_weights"):
        config.model_weights = ""
    parts = again._parts(config, model, first=False)  # headers only: no tensor byte read yet
    changed = previous.changes(checkpoints(parts))
    if changed:
        raise StreamloadError(
            f"the weights served before cannot be restored: {len(changed)} of the files they were loaded "
            f"from changed since ({'; '.join(changed)})"
        )
    weights = stream(again, config, model, tp_rank_world()[1], cooperative=False, parts=parts)
    try:
        restore.reload_over(model, model_config, weights)
    finally:
        weights.close()


def _because(ranks: Ranks, decided: Decision, why: Exception) -> str:
    """A failed reload's reasons: this rank's alone, or every rank's that had one (and why the ranks
    could not decide together, if they could not)."""
    if ranks.world == 1:
        return str(why)
    said = [f"rank {r}: {t}" for r, t in enumerate(decided.reasons) if t]
    return "; ".join([*said, decided.lost] if decided.lost else said)
