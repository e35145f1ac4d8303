"""A reload that fails leaves the weights it found, on every rank of the engine.

vLLM's in-place reload (`reload_weights(weights_path=...)`, the weight-transfer engine's updates)
empties each layer onto meta, and fills and processes it as its weights arrive, in place. A stream
that fails mid-way (a damaged byte caught by `verify`, a shard gone or cut short, a store refusing)
would leave the layers already filled with the new weights and the others on meta: a dead engine.
So the reload's feed (`StreamloadModelLoader.get_all_weights`) ends, on every rank, with a vote (one
all-reduce on vLLM's CPU world group: every pipeline stage and every tensor, expert and data parallel
rank, since a stage that kept new weights while another put old ones back would serve a mix); where
any rank failed, every rank puts
its layers back (vLLM's own finalisation), reads the weights it served before over them if anything
had arrived, and raises the error. Every parameter keeps its storage, so the engine serves the
previous weights at the same addresses.

The error is raised by the engine's last rank only, naming every rank's reason (the others log
it and return, their weights restored): vLLM's executor reads the workers' replies to a call in rank
order and stops at the first failure, leaving the later replies queued as the answers to the next
call (vLLM 0.32, `MultiprocExecutor.collective_rpc`), so a failure raised by every rank, or by a
rank before the last, would make the engine's next call fail with a stale error.

With `cooperative`, a rank that fails while its peers still exchange batches with it votes while they
wait in an exchange on the same group: they give up on it after the exchange's deadline and read its
share themselves (exchange.py) before they vote; the vote itself is not guarded against that
interleaving on every backend (tested: plain tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Served:
    """Where a model's current weights came from (`where`, resolved) and its config's fields then."""

    where: str
    model: str
    model_weights: str
    revision: str | None

    @staticmethod
    def of(where: str, model_config: Any) -> Served:
        return Served(where, model_config.model, getattr(model_config, "model_weights", ""), model_config.revision)

    def put_back(self, model_config: Any) -> None:
        """The config's fields as they were (vLLM's reload pointed them at the failed path)."""
        model_config.model, model_config.revision = self.model, self.revision
        if hasattr(model_config, "model_weights"):
            model_config.model_weights = self.model_weights


SERVED: WeakKeyDictionary[nn.Module, Served] = WeakKeyDictionary()


class Ranks:
    """Every rank of the engine: all pipeline stages, tensor, expert and data parallel ranks (vLLM's
    world group), which reload together and so decide together. A stage whose reload failed puts its
    layers back; one that succeeded must too, or the engine serves old layers before new ones."""

    def __init__(self, group: Any | None) -> None:
        self._group = group  # a torch.distributed group of them all (CPU), or None: a rank alone
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world = 1 if group is None else dist.get_world_size(group)

    @staticmethod
    def of_engine() -> Ranks:
        """vLLM's world group (None outside an engine: a model built alone)."""
        if not dist.is_initialized():
            return Ranks(None)
        from vllm.distributed import get_world_group

        return Ranks(get_world_group().cpu_group)

    @property
    def last(self) -> bool:
        """The rank that raises a failed reload's error (the module's docstring: why only one)."""
        return self.rank == self.world - 1

    def vote(self, ok: bool, touched: bool) -> tuple[bool, bool]:
        """(ok on every rank, touched on any): one collective, which every rank makes once per reload,
        at its end, whatever happened before."""
        if self.world == 1:
            return ok, touched
        flags = torch.tensor([0 if ok else 1, int(touched)])
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        except Exception:  # a peer that never voted: its weights are unknown, so are ours to it
            return False, True
        return not flags[0].item(), bool(flags[1].item())

    def reasons(self, why: str) -> list[str]:
        """Every rank's reason for a failed reload ("" where it had none), after a failed vote."""
        if self.world == 1:
            return [why]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, why, group=self._group)
        return [str(r or "") for r in every]


def put_back_layers(model: nn.Module, model_config: Any) -> None:
    """vLLM's own end of a layerwise reload: layers nothing arrived for get their old tensors back,
    layers filled in part are processed as they are (the previous weights are read over them after)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def reload_over(model: nn.Module, model_config: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """A whole layerwise reload of `weights`, in place, as vLLM's `reload_weights` makes one."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    put_back_layers(model, model_config)
