"""The first load, placed: a dry run of the model's `load_weights` (`placement/`) learns which part of
each tensor this rank keeps and where it lands; the stream reads only that part, straight into the
parameter, while the real call runs watched (a call unlike its dry run is redone with whole tensors).
What a checked dry run learnt is kept for the model's reloads (`PREDICTED`)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from streamload.base.stats import Stats
from streamload.format.header import TensorInfo
from streamload.integrations.vllm.feed import feed, load_weights_from
from streamload.integrations.vllm.files import Part, shapes
from streamload.integrations.vllm.placement import twins
from streamload.integrations.vllm.placement.dryrun import Copy, Diverged, Learned, dry_run, replay
from streamload.integrations.vllm.ranks import Ranks, tp_group, tp_rank_world
from streamload.integrations.vllm.report import last_load, record
from streamload.plan.plan import why_not_into
from streamload.plan.shard import Slice

log = logging.getLogger("vllm.streamload")

# The dry run and the watched real call cost ~0.57 ms a tensor here (vLLM's CPU build, Qwen3-MoE's
# per-expert loaders); what they save is a copy of each tensor's bytes, the weight loaders' work and,
# under tensor parallelism, the other ranks' parts. Twin layers are neither dry-run nor watched, so
# what counts is the tensors outside them; where those are many and small, every tensor loads whole
# through `load_weights`, as vLLM's own loader loads it.
MANY_TENSORS = 4096
SMALL_MEAN_BYTES = 4 << 20


def dry_run_worth_it(infos: Mapping[str, TensorInfo], watched: Collection[str]) -> bool:
    """Whether a dry run (or a watched real call) given the tensors `watched` is worth its per-tensor
    cost: few of them, or large ones on average."""
    if len(watched) <= MANY_TENSORS:
        return True
    return sum(infos[n].nbytes for n in watched if n in infos) / len(watched) >= SMALL_MEAN_BYTES


@dataclass
class Prediction:
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    parts: dict[str, Slice | None]  # taken by the model's loaders: this rank's part (None: all of it)
    unused: set[str]

    def learned(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Learned | None:
        """The prediction for a checkpoint of these tensors, or None where they differ."""
        if shapes != self.shapes:
            return None
        copies = {n: Copy(None, part) for n, part in self.parts.items()}  # type: ignore[arg-type]  # no dest
        return Learned(copies, set(self.unused))


# For models whose first load ran as its dry run predicted (checked by the replay): which part of each
# checkpoint tensor (by name, shape and dtype) the model's loaders took, and which they never looked
# at. A reload of a checkpoint with the same tensors reads the same parts (vLLM makes a new loader for
# each reload, and after the first load the parameters no longer carry their loaders to dry-run).
PREDICTED: weakref.WeakKeyDictionary[nn.Module, Prediction] = weakref.WeakKeyDictionary()


def load(
    model: nn.Module,
    parts: list[Part],
    options: dict[str, Any],
    stats: list[Stats],
    direct: bool | None,
    cooperative: bool,
    start: float,
) -> Any:
    """The model's weights from `parts` (their headers read since `start`): placed where a dry run pays
    (`direct`: the option, None: `dry_run_worth_it`) and the real call did what it predicted, else whole
    tensors through `load_weights`. Returns what `load_weights` returned."""
    shaped = shapes(parts)
    targets = [*model.parameters(), *model.buffers()]
    infos = {name: info for part in parts for name, info in part.names.items()}
    layers, spread = twins.sample(shaped), twins.Spread()
    learned = None
    if direct if direct is not None else dry_run_worth_it(infos, layers.sample):
        learned = _learn(model, parts, shaped, layers.sample, targets, options["device"])
    if learned is not None:
        try:
            spread = twins.spread(learned, layers, model)
        except Exception as exc:  # a model twins.py does not understand: its own loaders load it
            log.warning(
                "streamload: placing %s's layers alike failed (%s); loading whole tensors",
                type(model).__name__,
                exc,
            )
            learned = None
        else:
            if direct is None and not dry_run_worth_it(infos, shaped.keys() - learned.trusted):  # twins too few
                learned = None
    last_load.plan_seconds = time.perf_counter() - start
    last_load.diverged = {}
    world = tp_rank_world()[1]
    cooperative = cooperative and world > 1
    if cooperative:
        if not Ranks.of_tensor_parallel().all(learned is not None):  # the ranks exchange only if they all read alike
            learned = None
        options["cooperative"] = tp_group(options["device"])
    result: Any = None
    if learned is not None:
        try:  # the real call, watched: every name as in the dry run, placed tensors as their stand-ins
            with replay(learned, shaped, targets) as run:
                result = load_weights_from(model, feed(parts, options, stats, learned, run))
        except Diverged as exc:
            last_load.diverged = exc.names
        if not (Ranks.of_tensor_parallel().all(not last_load.diverged) if cooperative else not last_load.diverged):
            log.warning(
                "streamload: %s.load_weights did not do what its dry run predicted (%s); every tensor is "
                "read again, whole, and given to load_weights",
                type(model).__name__,
                Diverged(last_load.diverged) if last_load.diverged else "on another rank",
            )
            learned = None
    if learned is not None:
        PREDICTED[model] = Prediction(shaped, {n: c.part for n, c in learned.copies.items()}, set(learned.unused))
        result = spread.loaded(result) if result is not None else None
    if learned is None:
        result = load_weights_from(model, feed(parts, options, stats))
    record(parts, stats, learned, world)
    last_load.seconds = time.perf_counter() - start
    log.info(
        "streamload: %d tensors straight into their parameters (%d by a dry-run layer's twin), %d through "
        "load_weights%s, %d unused; %.1f of %.1f MB read by the %s reader",
        last_load.direct,
        last_load.by_twin,
        last_load.through_model,
        f" (e.g. {last_load.why_whole})" if last_load.why_whole else "",
        last_load.unused,
        last_load.bytes_read / 1e6,
        last_load.bytes_total / 1e6,
        last_load.reader or "no",
    )
    log.info("Loading weights took %.2f seconds", last_load.seconds)
    return result


def _learn(
    model: nn.Module,
    parts: list[Part],
    shaped: dict[str, tuple[tuple[int, ...], torch.dtype]],
    sample: list[str],
    targets: list[torch.Tensor],
    device: torch.device,
) -> Learned | None:
    """A dry run of `load_weights` given the tensors `sample` (of `shaped`: every tensor)."""
    if _quantized_while_loading(model):  # its loaders record what they get for later: no stand-ins
        return None
    try:
        learned, _ = dry_run(model.load_weights, {name: shaped[name] for name in sample}, targets)
    except Exception as exc:  # the real run gives the model's own error, if it is one
        log.warning(
            "streamload: the dry run of %s.load_weights failed (%s); loading whole tensors",
            type(model).__name__,
            exc,
        )
        return None
    for part in parts:
        learned.whole.update(dict.fromkeys(part.names.keys() - shaped.keys(), "no torch dtype"))
        for name, _ in part.others:
            learned.copies.pop(name, None)
            learned.unused.discard(name)
            learned.whole[name] = "a .pt/.bin file, read whole as vLLM reads it"
    for name, copy in list(learned.copies.items()):  # what the stream cannot write in place, the model does
        why = why_not_into(shaped[name][1], copy.dest, device)  # as `iter(into=...)` would refuse it
        if why or copy.dest.requires_grad:
            del learned.copies[name]
            learned.whole[name] = why or "its parameter requires grad"
    return learned


def _quantized_while_loading(model: nn.Module) -> bool:
    return any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules()) or any(
        p.is_meta for p in model.parameters()
    )
