"""The ranks of a cooperative load (a process group, or a fleet): who they are now, and their collectives.

A rank that fails, stops early or hangs must be an error on the others, not a hang: every collective is
waited for with a deadline a little shorter than the process group's own timeout. An NCCL collective
that misses it would otherwise spin on the GPU until NCCL's watchdog ends the whole process; the group's
communicators are aborted instead (the group is unusable afterwards, as after any NCCL timeout).

A rank that leaves on purpose says so: a stream closed before its end (a `break`, an exception in the
loop) or an iter() that failed (a bad argument on that rank only) leaves word in the group's store of
how many steps (the plan's agreement, then each shared batch) it took part in. The others look there
while they wait (every ~0.1 s) and stop waiting for it at once, as for a lost rank (lost_rank.py),
instead of after the deadline. Only a fleet not yet joined cannot be told (its rendezvous waits for
every member).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from streamload.base.errors import StreamloadError, UnsupportedError
from streamload.cooperative.fleet import Fleet
from streamload.device import kind_of
from streamload.plan.plan import Batch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

# The share of the process group's timeout a collective is waited for: it must act before NCCL's
# watchdog (which checks the same timeout) tears the process down.
DEADLINE_SHARE = 0.8


def all_gather(output: torch.Tensor, part: torch.Tensor, group: ProcessGroup | None = None) -> Work:
    """Start gathering every rank's equal-sized `part` into `output` (in place where `part` is its own
    slice of `output`): `all_gather_single` where torch has it, its older name elsewhere."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, part, group=group, async_op=True)


def group_timeout(group: ProcessGroup | None, device: torch.device) -> timedelta:
    """The timeout the process group's backend for `device` was created with (torch's default where
    the backend does not tell)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    with contextlib.suppress(AttributeError, RuntimeError):
        timeout = pg._get_backend(device).options._timeout
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    nccl = getattr(dist, "default_pg_nccl_timeout", None)  # NCCL's is shorter (its watchdog acts on it)
    on_nccl = kind_of(device).collective_backend == "nccl"
    return nccl if on_nccl and isinstance(nccl, timedelta) else dist.default_pg_timeout


def wait(work: Work, deadline: float, abort: Any, given_up: Callable[[], bool] | None = None) -> None:
    """Block until `work` completes; past `deadline` (a `time.monotonic()` value) call `abort(work)` and
    raise TimeoutError, as once `given_up()` says the other ranks gave up on it (asked every ~0.1 s).
    The backend's own error, if the collective failed, is raised as it is."""
    pause, asked = 50e-6, time.monotonic()
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            abort(work)
            raise TimeoutError("no answer from the other ranks in time")
        if given_up is not None and now - asked > 0.1:
            asked = now
            if given_up():  # not aborted: no rank sends on this group again, so nothing more can land
                raise TimeoutError("the other ranks gave up on this exchange (a rank was lost)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)  # quick collectives are seen quickly, long ones cost no CPU
    work.wait()


LOADS = itertools.count()  # cooperative loads of this process: every rank counts them alike


class Left(TimeoutError):
    """Ranks said they left the load (`ranks`: first rank -> the steps they took part in) before the
    step this rank waits in: no answer will come."""

    def __init__(self, ranks: dict[int, int], world: int) -> None:
        super().__init__()
        self.ranks, self.world = ranks, world
        self.waited = 0.0  # seconds this rank waited for them

    def __str__(self) -> str:
        def after(steps: int) -> str:
            return "before agreeing on the plan" if steps == 0 else f"after {steps - 1} shared batch(es)"

        said = "; ".join(f"rank {r} of {self.world} left the load {after(k)}" for r, k in sorted(self.ranks.items()))
        return (
            f"{said} (its stream was closed before the end, or its iter() failed): this rank stopped waiting "
            f"for it after {self.waited:.3g} s"
        )


def leave_early(group: ProcessGroup | Fleet | None) -> None:
    """This rank's iter() failed before it joined a cooperative load (a bad argument, a missing file):
    tells the others at once, where the group has a store, so that they read its share themselves."""
    import torch.distributed as dist

    number = next(LOADS)  # a load all the same: every rank counts them alike
    store, rank = None, 0
    with contextlib.suppress(Exception):  # no store (another group, a fleet not yet joined): nothing to tell
        if isinstance(group, Fleet):
            store, rank = group.joined_store(), group.rank
        elif group is None or group == dist.group.WORLD:
            store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    if store is not None:
        say_left(store, number, rank, 0)


def say_left(store: Any, number: int, rank: int, steps: int) -> None:
    """Leave word in the group's store that `rank` (of the first group) took part in `steps` steps of
    load `number` and no more (its value first: whoever sees the count reads it)."""
    with contextlib.suppress(Exception):  # the store may be gone with rank 0: no one is waiting then
        store.set(f"streamload/{number}/left/{rank}", str(steps))
        store.add(f"streamload/{number}/left", 1)


class Group:
    """The ranks of `group` (None: the default group) loading the same checkpoint together."""

    def __init__(self, group: ProcessGroup | Fleet | None, device: torch.device) -> None:
        import torch.distributed as dist

        self.device = device
        self.number = next(LOADS)
        self.fleet = group if isinstance(group, Fleet) else None
        if self.fleet is not None:  # streamload's own gloo group (through host slots), and its store
            self.store, self.backend = self.fleet.join()
            self.group, self._pg, self.on_device, self.timeout = None, self.backend, False, self.fleet.timeout
            self.rank, self.world = self.fleet.rank, self.fleet.world_size
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("cooperative loading needs an initialised torch.distributed process group")
            self.group, self._pg = group, group if group is not None else dist.group.WORLD
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            backend = str(dist.get_backend(group)).lower()
            kind = kind_of(device)  # device memory is exchanged where the group speaks its backend (NCCL for CUDA)
            self.on_device = not kind.host_memory and kind.collective_backend in backend
            if not self.on_device and "nccl" in backend and "gloo" not in backend:
                raise UnsupportedError(
                    f"cooperative loading to {device} needs a process group that can exchange host memory "
                    f"(gloo), not {backend!r}"
                )
            self.timeout = group_timeout(group, device if self.on_device else torch.device("cpu"))
            self.store, self.backend = None, None  # `backend`: the survivors' gloo group, once they form one
            if group is None or group == dist.group.WORLD:
                with contextlib.suppress(Exception):  # torch's private accessor: without it, no regrouping
                    self.store = dist.distributed_c10d._get_default_store()
        self.first_rank, self.first_world = self.rank, self.world
        self.members: tuple[int, ...] = tuple(range(self.world))  # ranks of the first group in the group now
        self.aborted = False
        self.lost = ""  # why no group is used any more: this rank then reads alone
        self.regrouped = 0  # times a group was formed among survivors
        self.load_key = str(self.number)  # this load in the group's store (agreement.py adds the plan's digest)
        self.steps = 0  # steps taken part in (the plan's agreement, then each shared batch): alike on all ranks
        self._total: int | None = None  # steps of the whole load, once planned
        self._left: dict[int, int] = {}  # first ranks that said they left -> the steps they took part in
        self._left_seen = 0  # how many had said so when last asked
        self._buffer: torch.Tensor | None = None  # where a host slot is gathered on the device

    def _collective(self, output: torch.Tensor, part: torch.Tensor) -> None:
        if self.backend is not None:
            work = self.backend._allgather_base(output, part)
        else:
            work = all_gather(output, part, self.group)
        self._wait(work)

    def _wait(self, work: Work) -> None:
        given_up = self._given_up if self.store is not None else None
        started = time.monotonic()
        try:
            wait(work, started + self.timeout.total_seconds() * DEADLINE_SHARE, self._abort, given_up)
        except Left as exc:
            exc.waited = time.monotonic() - started
            if self.on_device:  # as past the deadline: NCCL would spin on the GPU until its watchdog
                self._abort(work)
            raise
        except TimeoutError as exc:  # the seconds it took (gloo's thread is waited for past the deadline)
            raise TimeoutError(f"{exc} (waited {time.monotonic() - started:.3g} s)") from None

    def _given_up(self) -> bool:
        """Whether other ranks began to regroup (a rank was lost): this rank's exchange will not finish.
        Raises `Left` where a rank said it left the load before this step."""
        gone = self.gone()
        if gone:
            raise Left(gone, self.first_world)
        if self.on_device:  # an NCCL group is never regrouped
            return False
        with contextlib.suppress(Exception):
            return bool(self.store.check([f"{self.regroup_key()}/count"]))
        return False

    def gone(self) -> dict[int, int]:
        """Members that said they left the load before this step (first rank -> the steps they took part
        in): they will not answer, nor say they are alive."""
        key = f"streamload/{self.number}/left"
        with contextlib.suppress(Exception):  # no word from the store: the deadline still holds
            count = self.store.add(key, 0)
            if count > self._left_seen:
                self._left_seen = count
                for r in self.members:
                    if r != self.first_rank and r not in self._left and self.store.check([f"{key}/{r}"]):
                        self._left[r] = int(self.store.get(f"{key}/{r}"))
        return {r: k for r, k in self._left.items() if r in self.members and k <= self.steps}

    def regroup_key(self) -> str:
        """Where the survivors meet in the group's store should this group lose a rank."""
        return f"streamload/{self.load_key}/{self.regrouped + 1}"

    def expect(self, shared_batches: int) -> None:
        """The plan is made: the load is its agreement and `shared_batches` exchanges."""
        self._total = 1 + shared_batches

    def leave(self) -> None:
        """Tell the others this rank takes no part in the rest of the load (its stream was closed before
        the end, or its iter() failed), where it has not taken part in all of it: they stop waiting at once."""
        if self.store is not None and (self._total is None or self.steps < self._total):
            say_left(self.store, self.number, self.first_rank, self.steps)
            self._total = self.steps  # said once

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """`t` from rank `root` of the survivors' group to every other (only after a regroup)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        self._wait(self.backend.broadcast([t], options))

    def _abort(self, work: Work) -> None:
        if self.on_device:  # NCCL: a collective that would spin on the GPU until the watchdog ends the process
            self._pg.abort()  # (an NCCL group is never regrouped: the group given is the one aborted)
            self.aborted = True
            return
        # gloo: its thread may still write into the slot until gloo's own timeout (the other 20%); the
        # slot is given back (to later loads) only once it no longer can.
        with contextlib.suppress(Exception):
            work.wait()

    def part(self, batch: Batch) -> tuple[int, int]:
        """This rank's part of a shared batch: where it starts, and every part's size (the last rounded up)."""
        size = -(-batch.extent // self.world)
        return self.rank * size, size

    def gather(self, batch: Batch, slot: torch.Tensor) -> torch.Tensor:
        """Blocking: every rank's part of `batch` into one buffer (`slot`, or the device buffer), returned."""
        lo, size = self.part(batch)
        target = slot
        kind = kind_of(self.device)
        with kind.copy_stream(self.device) if self.on_device else contextlib.nullcontext():
            if self.on_device and slot.is_cpu:  # a host slot (the posix reader's): copied to the device first
                kind.pin_slot(slot, batch.extent)
                if self._buffer is None:
                    self._buffer = torch.empty(slot.numel(), dtype=torch.uint8, device=self.device)
                target = self._buffer
                target[lo : lo + size].copy_(slot[lo : lo + size], non_blocking=True)
            try:
                self._collective(target[: size * self.world], target[lo : lo + size])
            except Exception as exc:
                raise self._failed(batch, exc) from exc
        return target

    def gather_small(self, t: torch.Tensor) -> torch.Tensor:
        """All ranks' `t`, stacked (exchanged on the group's device, returned on the host)."""
        where = self.device if self.on_device else torch.device("cpu")
        t = t.to(where)
        out = torch.empty((self.world, t.numel()), dtype=t.dtype, device=where)
        self._collective(out.view(-1), t)
        return out.cpu()

    def _failed(self, batch: Batch, exc: Exception) -> StreamloadError:
        names = sorted({p.item.name for p in batch.pieces})
        paths = sorted({str(p.item.info.path) for p in batch.pieces})
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        deadline = self.timeout.total_seconds() * DEADLINE_SHARE
        why = (
            f"{exc}" if isinstance(exc, Left) else
            f"a rank failed, stopped early, or did not answer within {deadline:.3g} s ({DEADLINE_SHARE:.0%} of the "
            f"process group's timeout): {exc}"
        )  # fmt: skip
        return StreamloadError(
            f"{', '.join(paths)}: rank {self.first_rank} of {self.first_world}: exchanging tensors {shown} with the "
            f"other ranks failed; {why}{'; the process group was aborted' if self.aborted else ''}"
        )

    def close(self) -> None:
        """Let go of everything of torch.distributed's it holds (the group, the store, a survivors'
        group): a stream kept after the load (`with iter(...) as stream`, then `stream.stats`) must not
        keep them alive past the caller's `destroy_process_group`, nor until the interpreter's exit. The
        others are told where this rank leaves before the end of the load."""
        self.leave()
        self._buffer = None
        self.backend = self.store = self._pg = self.group = None
