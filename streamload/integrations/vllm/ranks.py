"""The engine's ranks, and the collectives the integration makes over vLLM's groups (`Ranks`). Every
collective here is made by every rank of its group at the same point, once: a rank that skipped one
would leave the others waiting in it until the group's timeout.

The vote at the end of a reload (`Ranks.decide`, reload.py): a peer that never votes (its process
died, or it hangs) fails the vote: gloo sees a dead peer's connections close at once (~30 ms
measured), and gives up on a live one after the group's timeout (vLLM's
`cpu_distributed_timeout_seconds`; torch's default for gloo is 30 minutes). Ranks legitimately reach
the vote far apart (one still streaming its larger share), so no shorter bound is safe. A rank whose
vote was lost asks its peers nothing more (a second collective on a broken group raises or waits as
long again).

With `cooperative`, a rank that fails while its peers still exchange batches with it votes while they
wait in an exchange on the same group: they give up on it after the exchange's deadline and read its
share themselves (cooperative/exchange.py) before they vote; the vote itself is not guarded against that
interleaving on every backend (tested: plain tensor parallelism).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class Ranks:
    """Ranks of a torch.distributed group that decide together: every rank of the engine (`of_engine`:
    all pipeline stages, tensor, expert and data parallel ranks) or the tensor-parallel ones."""

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

    @staticmethod
    def of_tensor_parallel() -> Ranks:
        from vllm.distributed import get_tp_group

        return Ranks(get_tp_group().cpu_group)

    @property
    def last(self) -> bool:
        """The rank that raises a failed reload's error (reload.py: why only one)."""
        return self.rank == self.world - 1

    def barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def all(self, ok: bool) -> bool:
        return self.vote(ok, False)[0]

    def vote(self, ok: bool, touched: bool) -> tuple[bool, bool]:
        """(ok on every rank, touched on any): one collective. Raises where a peer never votes."""
        if self.world == 1:
            return ok, touched
        flags = torch.tensor([0 if ok else 1, int(touched)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return not flags[0].item(), bool(flags[1].item())

    def reasons(self, why: str) -> list[str]:
        """Every rank's reason for a failed reload ("" where it had none)."""
        if self.world == 1:
            return [why]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, why, group=self._group)
        return [str(r or "") for r in every]

    def decide(self, why: str | None, touched: bool) -> Decision:
        """The vote (`why`: this rank's failure, None if it had none), and every rank's reasons where it
        failed. Never raises: a vote lost with a peer decides "failed, maybe touched" on this rank
        alone, and asks nothing more of the group (`Decision.lost`)."""
        mine = why or ""
        alone = ["" if r != self.rank else mine for r in range(self.world)]
        try:
            ok, touched = self.vote(why is None, touched)
        except Exception as exc:  # a peer that never voted: its weights are unknown, so are ours to it
            return Decision(False, True, alone, f"the engine's ranks could not vote ({_short(exc)})")
        if ok:
            return Decision(True, touched, [])
        try:
            return Decision(False, touched, self.reasons(mine))
        except Exception as exc:  # a peer lost after the vote: the decision stands, its reason is unknown
            return Decision(False, touched, alone, f"the engine's ranks could not share their reasons ({_short(exc)})")


class Decision(NamedTuple):
    ok: bool
    touched: bool  # new weights reached some layer on some rank (or may have: a lost vote)
    reasons: list[str]  # every rank's reason ("" where none); only this rank's where the vote was lost
    lost: str = ""  # why the ranks could not decide together (a peer gone, or past the group's timeout)


def _short(exc: BaseException) -> str:
    """A collective's error in one line (gloo's carry a source location and a long hint)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("] ", 1)[-1].split(" This is typically", 1)[0][:300]


def tp_rank_world() -> tuple[int, int]:
    """This rank and the number of tensor-parallel ranks."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no model-parallel groups: a model built outside an engine
        return 0, 1


def tp_group(device: torch.device) -> Any:
    """vLLM's group of the tensor-parallel ranks for a cooperative stream onto `device`."""
    from vllm.distributed import get_tp_group

    from streamload.device import KINDS

    group = get_tp_group()
    kind = KINDS.get(device.type)  # None: a type streamload does not serve, whose collectives go on the CPU group
    return group.device_group if kind is not None and not kind.host_memory else group.cpu_group
