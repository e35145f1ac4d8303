"""What a run does, recorded (`Recorder`): the stand-ins' copies into real tensors, other writes into
parameters, parameters rebound or handed to numpy; whether the stream can make a dry run's copy
(`Recorder.verdict`, `copy_of`), or where a replay's real call did otherwise."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from streamload.integrations.vllm.placement.learned import Copy, Diverged, Learned
from streamload.integrations.vllm.placement.standin import StandIn
from streamload.plan.shard import Slice

# a view's identity: storage, offset, shape, stride, dtype
ViewKey = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def view_key(t: torch.Tensor) -> ViewKey:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Recorder:
    """What a run does to stand-ins and to real tensors. `expected`: None in a dry run; in a replay,
    the dry run's prediction, held against what the real call does."""

    def __init__(self, params: Iterable[torch.Tensor], expected: Learned | None = None) -> None:
        self.expected = expected
        self.params = [p for p in params if not p.is_meta]
        self.bindings = [view_key(p) for p in self.params]  # `param.data = x` changes these
        self.saved = [p.data for p in self.params]
        self.storages = {k[0] for k in self.bindings}
        self.copies: dict[str, list[tuple[torch.Tensor, StandIn]]] = {}
        self.tainted: dict[str, str] = {}  # name -> the first call that made it unpredictable
        self.events = 0  # orders landings and writes
        self.landed: dict[int, list[tuple[str, int, int, int]]] = {}  # storage -> (name, first, end, when)
        self.writes: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (first, end, when) of other writes
        self.escaped: set[int] = set()  # storages handed to numpy / dlpack: writes there are unseen
        self.diverged: dict[str, str] = {}
        self.landed_at: dict[str, int] = {}  # dry run: when each name's (last) copy landed
        self.placed: dict[str, int] = {}  # replay: how often each predicted copy was made (skipped)
        if expected is not None:  # the regions the stream fills before or while the real call runs
            for name, copy in expected.copies.items():
                first, end = span(copy.dest)
                self.landed.setdefault(copy.dest.untyped_storage().data_ptr(), []).append((name, first, end, 0))

    def copied(self, name: str, dest: torch.Tensor, src: StandIn) -> None:
        if self.expected is not None:
            predicted = self.expected.copies.get(name)
            made = copy_of(dest, src)
            if (
                predicted is None
                or made is None
                or made.part != predicted.part
                or view_key(made.dest) != view_key(predicted.dest)
            ):
                raise Diverged({name: "copied elsewhere than its dry run predicted"})
            self.placed[name] = self.placed.get(name, 0) + 1
            return
        self.copies.setdefault(name, []).append((dest, src))
        if not dest.is_meta:
            first, end = span(dest)
            self.events += 1
            self.landed.setdefault(dest.untyped_storage().data_ptr(), []).append((name, first, end, self.events))
            self.landed_at[name] = self.events

    def written(self, target: torch.Tensor) -> None:
        """`target` is written by something other than a stand-in's copy."""
        if target.is_meta or isinstance(target, StandIn):
            return
        storage, (first, end) = target.untyped_storage().data_ptr(), span(target)
        if self.expected is not None:
            for name, lo, hi, _ in self.landed.get(storage, ()):
                if lo < end and first < hi:
                    self.diverged.setdefault(name, "its region, already filled, is written by the loader")
            return
        self.events += 1
        self.writes.setdefault(storage, []).append((first, end, self.events))

    def escape(self, target: torch.Tensor) -> None:
        """`target`'s memory is handed outside torch (numpy, dlpack): what is written there is unseen."""
        if target.is_meta or isinstance(target, StandIn):
            return
        storage = target.untyped_storage().data_ptr()
        self.escaped.add(storage)
        if self.expected is not None:
            for name, *_ in self.landed.get(storage, ()):
                self.diverged.setdefault(name, "its parameter is handed to numpy or dlpack")

    def rebound(self) -> dict[int, str]:
        """Storages whose parameter was rebound (`param.data = x`) during the run; the bindings are put
        back after a dry run (a stand-in bound to a parameter would break the real load)."""
        moved = {}
        for p, key, saved in zip(self.params, self.bindings, self.saved, strict=True):
            if view_key(p) != key:
                moved[key[0]] = "its parameter is rebound (`.data = ...`) by the loader"
                if self.expected is None:
                    with torch.no_grad():
                        p.data = saved
        return moved

    def verdict(self, name: str, dest: torch.Tensor) -> str:
        """Why a dry run's single copy of `name` into `dest` cannot be made by the stream, or ""."""
        storage, when = dest.untyped_storage().data_ptr(), self.landed_at[name]
        if storage not in self.storages:
            return "copied into a tensor that is not a parameter or buffer (a temporary)"
        if storage in self.escaped:
            return "its parameter is handed to numpy or dlpack"
        first, end = span(dest)
        for other, lo, hi, at in self.landed.get(storage, ()):
            if (other != name or at != when) and lo < end and first < hi:
                return f"its region is also written from {other!r}"
        for lo, hi, at in self.writes.get(storage, ()):
            if lo < end and first < hi:
                return (
                    "its parameter is written again after the copy"
                    if at > when
                    else "its parameter is written before the copy (the stream may fill it first)"
                )
        return ""


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [first, end)."""
    size = t.element_size()
    first = t.storage_offset() * size
    if t.numel() == 0:
        return first, first
    return first, first + (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * size


def copy_of(dest: torch.Tensor, src: StandIn) -> Copy | None:
    """The single-dimension slice `src` is of its root, written into `dest`; None if it is not one."""
    if not src.plain or dest.is_meta or dest.numel() != src.numel():
        return None
    if src.axes is None:  # the whole tensor in another shape (a scalar as [1]): write it with the root's
        return _as(dest, src.full, None)
    spans: dict[int, tuple[int, int]] = {}
    for dim, start, length in src.narrows:
        lo, _ = spans.get(dim, (0, src.full[dim]))
        spans[dim] = (lo + start, length)
    cut = {d: s for d, s in spans.items() if s != (0, src.full[d])}
    if len(cut) > 1:
        return None
    shape = tuple(spans.get(d, (0, n))[1] for d, n in enumerate(src.full))
    if not cut:
        return _as(dest, shape, None)
    ((dim, (start, length)),) = cut.items()
    return _as(dest, shape, Slice(dim, start, length))


def _as(dest: torch.Tensor, shape: tuple[int, ...], part: Slice | None) -> Copy | None:
    """`dest` seen with the delivered tensor's shape (they differ by dimensions of size 1 at most)."""
    if tuple(dest.shape) == shape:
        return Copy(dest, part)
    try:
        return Copy(dest.view(shape), part)
    except RuntimeError:
        return None
