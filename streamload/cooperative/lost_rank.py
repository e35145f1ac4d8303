"""A lost rank costs the others time, not the load.

Once an exchange fails (a rank died, its link broke, it did not answer in time, or it said it left), the
survivors form a new group without it through the process group's own store (torch's TCPStore, where
`init_process_group` put it): each says it is alive there (a rank still waiting in an exchange sees that
and stops waiting), the first to decide writes who answered until none more came for `GRACE` seconds,
and those build a gloo group of their own. Batches read under the old group are completed from the
survivors' parts and the lost rank's part, which the survivors read from storage a share each (storage
serves it once, not once per survivor); later batches are divided among the survivors. Where no new
group can be formed (an NCCL group, a group other than the default one, the store gone with rank 0, a
second failure), each rank reads what the others would have shared from storage itself. A warning names
the lost ranks; only when storage cannot serve those bytes either is the load an error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from streamload.base.errors import StreamloadError
from streamload.cooperative.group import Group
from streamload.plan.plan import Batch

log = logging.getLogger("streamload")

GRACE = 1.0  # seconds survivors wait, after the last one said it is alive, for more

Read = Callable[[Batch], None]  # reads a window of a batch into its slot, blocking


def complete(group: Group, batch: Batch, slot: torch.Tensor, then: tuple[int, ...], read: Read) -> torch.Tensor:
    """Blocking: `batch`, of which this rank read its part among the ranks `then`, made whole in a
    buffer that is returned — from the others, or, what they cannot give, from storage (`read`)."""
    whole = _complete(group, batch, slot, then, read)
    group.steps += 1
    return whole


def _complete(group: Group, batch: Batch, slot: torch.Tensor, then: tuple[int, ...], read: Read) -> torch.Tensor:
    if group.regrouped and not group.lost:
        _agree_on(group, batch, then)
    if not group.lost and then == group.members:
        try:
            return group.gather(batch, slot)  # a collective: in plan order on every rank
        except StreamloadError as exc:
            regroup(group, exc)
            if not group.lost:
                _agree_on(group, batch, then)
    if not group.lost:
        try:
            _fill(group, batch, slot, then, read)
            return slot
        except Exception as exc:
            lose(group, f"completing {batch.pieces[0].item.info.path} with the other survivors failed: {exc}")
    size = -(-batch.extent // len(then))
    mine = then.index(group.first_rank) * size
    for window in (batch.window(0, mine), batch.window(mine + size, batch.extent)):
        if window.pieces:
            read(window)
    return slot


def _agree_on(group: Group, batch: Batch, then: tuple[int, ...]) -> None:
    """After a regroup, the survivors check they complete the same batch the same way: a rank may
    have noticed the loss one batch later than another, or read a batch under the old group that
    another read under the new one. Where they differ, every one of them goes on alone."""
    try:
        every = group.gather_small(torch.tensor([batch.index, int(then == group.members)], dtype=torch.int64))
    except Exception as exc:
        lose(group, f"the survivors could not compare their progress: {exc}")
        return
    if not bool((every == every[0]).all()):
        lose(group, f"the survivors were not at the same batch (batch, read by the new group: {every.tolist()})")


def _fill(group: Group, batch: Batch, slot: torch.Tensor, then: tuple[int, ...], read: Read) -> None:
    """`batch` was read in parts by the ranks `then`: a survivor's part comes from it; a lost rank's
    part is read from storage by the survivors, a share each, and shared."""
    size = -(-batch.extent // len(then))
    for i, first_rank in enumerate(then):
        lo, hi = i * size, min((i + 1) * size, batch.extent)
        if lo >= hi:
            continue
        if first_rank in group.members:
            group.broadcast(slot[lo:hi], group.members.index(first_rank))
            continue
        share = -(-(hi - lo) // group.world)
        for j in range(group.world):
            a, b = lo + j * share, min(hi, lo + (j + 1) * share)
            if a < b:
                if j == group.rank:
                    read(batch.window(a, b))
                group.broadcast(slot[a:b], j)


def regroup(group: Group, exc: Exception) -> None:
    """The survivors of a failed exchange agree who they are (through the group's store) and form
    a gloo group of their own; where they cannot, this rank goes on alone (`lost`)."""
    import torch.distributed as dist

    if group.on_device or group.store is None:
        lose(group, str(exc))
        return
    key = group.regroup_key()
    try:
        store = group.store
        store.set(f"{key}/alive/{group.first_rank}", b"1")
        seen, since = store.add(f"{key}/count", 1), time.monotonic()
        while seen < len(group.members) - len(group.gone()) and time.monotonic() - since < GRACE:
            time.sleep(0.05)
            now = store.add(f"{key}/count", 0)
            if now != seen:
                seen, since = now, time.monotonic()
        alive = [r for r in group.members if store.check([f"{key}/alive/{r}"])]
        agreed = store.compare_set(f"{key}/members", "", json.dumps(alive))  # the first to decide wins
        members = tuple(json.loads(agreed))
        if group.first_rank not in members:
            lose(group, f"{exc}; the others went on without this rank")
            return
        rank = members.index(group.first_rank)
        backend = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/group/", store), rank, len(members), group.timeout)
    except Exception as again:
        lose(group, f"{exc}; forming a group of the survivors failed too: {again}")
        return
    lost = sorted(set(group.members) - set(members))
    log.warning(
        "streamload: %s; ranks %s of the first group are lost: %s, reading what the lost ones would have "
        "shared from storage%s", exc, lost, f"{len(members)} ranks go on together" if len(members) > 1 else
        "this rank goes on alone", ", a share each" if len(members) > 1 else "",
    )  # fmt: skip
    group.members, group.rank, group.world, group.backend = members, rank, len(members), backend
    group.regrouped += 1
    if group.fleet is not None:  # its group has lost a member: a later load forms it anew
        group.fleet.forget()


def lose(group: Group, why: str) -> None:
    """This rank goes on alone: it reads from storage whatever the others would have shared."""
    group.lost = why
    if group.fleet is not None:
        group.fleet.forget()
    log.warning("streamload: %s; this rank reads the rest from storage itself", why)
