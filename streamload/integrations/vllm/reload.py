"""In-place reloads (`StreamloadModelLoader.get_all_weights`): the stream vLLM's `reload_weights` feeds
`load_weights`, and, where a reload fails on any rank, the weights served before put back on every one.

vLLM's in-place reload empties each layer onto meta and fills and processes it as its weights arrive.
A stream that fails mid-way (a damaged byte caught by `verify`, a shard gone or cut short, a store
refusing), or a model whose `load_weights` raises mid-way, would leave some layers new and the others
on meta: a dead engine. So the reload's feed ends, on every rank and every way out of it (its end, its
error, its close when its consumer raised), with a vote (`ranks.Ranks.decide`) on vLLM's CPU world
group: every pipeline stage and every tensor, expert and data parallel rank, since a stage that kept
new weights while another put old ones back would serve a mix. Where any rank failed, every rank puts
its layers back (vLLM's own finalisation), reads the weights it served before over them if anything
had arrived (only from the very files read then: restore.py), and raises the error. Every parameter
keeps its storage, so the engine serves the previous weights at the same addresses.

The stream's error is raised by the engine's last rank only, naming every rank's reason (the others
log it and return, their weights restored): vLLM's executor reads the workers' replies to a call in
rank order and stops at the first failure, leaving the later replies queued as the answers to the next
call (vLLM 0.32, `MultiprocExecutor.collective_rpc`), so a failure raised by a rank before the last
would make the engine's next call fail with a stale error. A rank whose vote was lost (a peer died or
hung: ranks.py) asks its peers nothing more: it restores and raises (every such rank: the engine has
lost a worker, so the rank-order reasoning no longer holds).

A rank whose model raised learns it only when the stream is closed (vLLM's `reload_weights` lets go of
it with the error; the weight-transfer engine closes it itself: sync.py). That rank votes "failed" from
the close, every rank restores, and the model's own error is the one raised, by that rank, once: no
rank raises streamload's over it. Where that rank is not the last, vLLM's executor stops at its reply
and leaves the later ranks' replies queued (above): nothing a loader can change.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from copy import copy as shallow_copy

import torch
from torch import nn
from vllm.config import ModelConfig

from streamload.base.errors import StreamloadError
from streamload.integrations.vllm import restore
from streamload.integrations.vllm.direct import PREDICTED
from streamload.integrations.vllm.feed import feed
from streamload.integrations.vllm.files import Part, checkpoints, shapes
from streamload.integrations.vllm.ranks import Decision, Ranks, tp_group, tp_rank_world
from streamload.integrations.vllm.report import record
from streamload.integrations.vllm.state import LoadState

log = logging.getLogger("vllm.streamload")


# A rank whose model's `load_weights` raised (or stopped reading) votes this reason: the model's error is
# raised by that rank, once, so no rank raises streamload's own over it.
STOPPED = "its model's load_weights raised (its own error, raised by that rank) or stopped reading"


def guarded(state: LoadState, model_config: ModelConfig, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
    """The reload's stream (`stream`), then the vote of every rank, on every way out (module docstring);
    where any rank failed, this rank's previous weights are put back and the error raised."""
    failure: Exception | None = None
    stopped = False
    touched = False
    weights = stream(state, model_config, model, bool(state.options.get("cooperative")))
    try:  # vLLM's reload has emptied the layers: from here every rank votes, whatever happens
        for pair in weights:
            touched = True
            yield pair
    except Exception as exc:  # the stream's error (or the headers')
        failure = exc
    except GeneratorExit:  # closed early: nothing more is yielded, but this rank still votes and restores
        stopped = True
    finally:
        try:  # its threads and slots let go of before anything reads again
            weights.close()
        except Exception as exc:  # the close's own error, where there was none: it must not skip the vote
            failure = failure or exc
    # The vote (one collective, on every rank); nothing is yielded from here: this may run in the close.
    ranks = Ranks.of_engine()
    why_mine = STOPPED if stopped else None if failure is None else str(failure)
    decided = ranks.decide(why_mine, touched)  # never raises
    if decided.ok:
        restore.SERVED[model] = state.served(model_config, state.reloaded)
        return
    previous = restore.SERVED.get(model)
    why = failure or StreamloadError(decided.lost or (STOPPED if stopped else "another rank of the engine failed"))
    wanted = state.where or model_config.model
    _restore(state, previous, decided.touched, model_config, model, f"reloading from {wanted} failed ({why})")
    served = previous.where if previous is not None else "the weights it had"
    message = f"reloading from {wanted} failed; serving {served} again: {_because(ranks, decided, why)}"
    model_raised = STOPPED in decided.reasons  # that rank raises the model's own error: none other is raised
    if stopped or ((not ranks.last or model_raised) and not decided.lost):
        log.error("streamload: %s", message)
        return
    raise StreamloadError(message) from why


def stream(
    state: LoadState,
    model_config: ModelConfig,
    model: nn.Module,
    cooperative: bool,
    parts: list[Part] | None = None,
) -> Generator[tuple[str, torch.Tensor]]:
    """(name, tensor) in layer order: where the first load's prediction (`direct.PREDICTED`) holds for
    these tensors, each rank's part only, full-shaped; otherwise whole tensors."""
    parts = parts if parts is not None else state.parts(model_config, model, first=False)
    state.reloaded, state.stats = parts, []
    options = state.stream_options(model)
    world = tp_rank_world()[1]
    predicted = PREDICTED.get(model)
    learned = predicted.learned(shapes(parts)) if predicted is not None else None
    if cooperative and world > 1:
        if not Ranks.of_tensor_parallel().all(learned is not None):
            learned = None
        options["cooperative"] = tp_group(options["device"])
    weights = feed(parts, options, state.stats, learned, full_shaped=learned is not None)
    try:
        yield from weights
    finally:
        weights.close()
    record(parts, state.stats, learned, world)


def _restore(
    state: LoadState,
    previous: restore.Served | None,
    touched: bool,
    model_config: ModelConfig,
    model: nn.Module,
    failed: str,
) -> None:
    """This rank's layers put back and, where new weights reached any (or may have), the previous
    weights read over them; `failed`: what went wrong before, for the error."""
    try:
        restore.put_back_layers(model, model_config)
        if touched:  # new weights reached some layer on some rank: the previous ones are read again
            if previous is None:
                raise StreamloadError("no earlier load of this model by streamload is known to read again")
            _read_again(state, previous, model_config, model)
    except Exception as again:
        raise StreamloadError(
            f"{failed}, and so did restoring {previous.where if previous else 'the weights served before'} "
            f"({again}): this worker's weights are a mix; restart it"
        ) from again
    finally:
        if previous is not None:
            previous.put_back(model_config)


def _read_again(state: LoadState, previous: restore.Served, model_config: ModelConfig, model: nn.Module) -> None:
    """The weights `previous` names, read over the model in place from the very files read then (each
    rank alone, unchecked: they were checked when first read); where any changed since, nothing is read
    and the error names each file and what changed."""
    again = LoadState(state.load_config, {k: v for k, v in state.options.items() if k not in ("cooperative", "verify")})
    config = shallow_copy(model_config)
    config.model, config.model_weights, config.revision = previous.where, "", None
    parts = again.parts(config, model, first=False)  # headers only: no tensor byte read yet
    if changed := previous.changes(checkpoints(parts)):
        raise StreamloadError(
            f"the weights served before cannot be restored: {len(changed)} of the files they were loaded "
            f"from changed since ({'; '.join(changed)})"
        )
    weights = stream(again, config, model, cooperative=False, parts=parts)
    try:
        restore.reload_over(model, model_config, weights)
    finally:
        weights.close()


def _because(ranks: Ranks, decided: Decision, why: Exception) -> str:
    """A failed reload's reasons: this rank's alone, or every rank's that had one (and why the ranks
    could not decide together)."""
    if ranks.world == 1:
        return str(why)
    said = [f"rank {r}: {t}" for r, t in enumerate(decided.reasons) if t]
    return "; ".join([*said, decided.lost] if decided.lost else said)
