"""The stream handed to the model's `load_weights`: (name, tensor) of every part of the checkpoint, in
the stream's order; with a dry run's prediction, each placed tensor read straight into place and
handed on as its stand-in, or (a reload) read in this rank's part only and handed on full-shaped."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Generator, Iterable, Iterator
from contextlib import closing, nullcontext
from typing import Any

import torch
from torch import nn

from streamload import api
from streamload.base.stats import Stats
from streamload.format.dtypes import torch_shape
from streamload.integrations.vllm.files import Part
from streamload.integrations.vllm.placement.dryrun import Diverged, Learned, Replay
from streamload.integrations.vllm.ranks import tp_rank_world
from streamload.plan.shard import SKIP, ShardSpec, Slice


def feed(
    parts: list[Part],
    options: dict[str, Any],
    stats: list[Stats],
    learned: Learned | None = None,
    run: Replay | None = None,
    full_shaped: bool = False,
) -> Generator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every part in turn, as `load_weights` gets them; each stream's stats appended
    to `stats` once it is read. `learned`: a dry run's prediction, replayed as `run` (a first load), or
    `full_shaped` (a reload)."""
    quiet = run.paused if run is not None else nullcontext
    for part in parts:
        if part.checkpoint is not None:
            placed: dict[str, Any] = {}
            if learned is not None:
                placed["shard"] = ShardSpec(_rule(learned, part.prefix), *tp_rank_world(), full_shape=full_shaped)
                if not full_shaped:
                    placed["into"] = {
                        n[len(part.prefix) :]: learned.copies[n].dest for n in part.names if n in learned.copies
                    }
            with quiet():  # planned and closed unwatched: during a replay, the stream's work is not the loader's
                stream = api.iter(part.checkpoint, **options, **placed)
            try:
                if full_shaped:
                    assert learned is not None
                    yield from _full_shaped(stream, part, learned)
                else:
                    yield from _tensors(stream, part, learned, run)
            finally:
                with quiet():
                    stream.close()
            stats.append(stream.stats)
        yield from part.others


def load_weights_from(model: nn.Module, weights: Generator[tuple[str, torch.Tensor]]) -> Any:
    """`model.load_weights(weights)`; then whatever it left unread is read, so that cooperative ranks
    stay in step (also when the call diverged from its dry run) and placed tensors land; the feed (its
    stream) is closed on every way out."""
    with closing(weights):
        try:
            result = model.load_weights(weights)
        except Diverged:
            deque(weights, maxlen=0)  # read to its end
            raise
        deque(weights, maxlen=0)
        return result


def _rule(learned: Learned, prefix: str) -> Any:
    """A `ShardSpec` rule for one part's stream: each placed tensor's predicted part, SKIP for unused."""

    def rule(name: str, shape: tuple[int, ...]) -> Slice | str | None:
        copy = learned.copies.get(prefix + name)
        if copy is not None:
            return copy.part
        return SKIP if prefix + name in learned.unused else None

    return rule


def _tensors(
    stream: Any, part: Part, learned: Learned | None, run: Replay | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A part's stream as `load_weights` gets it: with a replay, placed and unused tensors as their
    stand-ins (the unused ones, never read, where the dry run had them)."""
    if learned is None or run is None:
        yield from ((part.prefix + name, t) for name, t in stream)
        return
    trusted = learned.trusted
    for name, t in _in_order(part, _paused(stream, run, part.prefix, trusted), learned.unused - trusted):
        yield name, run.stand_in(name) if t is None or name in learned.copies else t


def _paused(stream: Any, run: Replay, prefix: str, trusted: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's tensors but the `trusted` ones (in place already, and not for the real call), taken
    with the replay's watch paused: the stream's own writes into place are not the loader's."""
    arrived = iter(stream)
    while True:
        with run.paused():
            item = next((item for item in arrived if prefix + item[0] not in trusted), None)
        if item is None:
            return
        yield item


def _full_shaped(stream: Any, part: Part, learned: Learned) -> Iterator[tuple[str, torch.Tensor]]:
    """A reload's stream as `load_weights` gets it: a tensor never looked at is handed on uninitialised
    (host memory commits only the pages written)."""
    unused: list[str] = []  # made on the next tensor's device (after the last one: the host)
    for name, t in _in_order(part, stream, learned.unused):
        if t is None:
            unused.append(name)
            continue
        yield from ((n, _empty(part.names[n], t.device)) for n in unused)
        unused.clear()
        yield name, t
    yield from ((n, _empty(part.names[n], None)) for n in unused)


def _in_order(
    part: Part, arrived: Iterable[tuple[str, torch.Tensor]], unused: Collection[str]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The names `load_weights` gets from a part, in the stream's order: each tensor that arrived
    (prefixed), and each name the dry run left unused (never read: None) at its place among them."""
    pending = iter(part.names)
    for name, t in arrived:
        name = part.prefix + name
        for before in pending:
            if before == name:
                break
            if before in unused:
                yield before, None
        yield name, t
    yield from ((n, None) for n in pending if n in unused)


def _empty(info: Any, device: torch.device | None) -> torch.Tensor:
    return torch.empty(torch_shape(info.dtype, info.shape), dtype=info.dtype.torch_dtype, device=device)
