"""A dry run of a weight-loading function: which part of each checkpoint tensor it copies where, and a
watched replay of the real call that proves the prediction held.

Servers fill their parameters through loader functions that narrow each checkpoint tensor to the
rank's part and `copy_` it into (a view of) a parameter, e.g. vLLM's `model.load_weights`. Calling
such a function with stand-ins — meta tensors of the checkpoint's shapes that record the `narrow`s
applied to them and the `copy_` that consumes them, copying nothing — tells which bytes of each
tensor this rank keeps and where they go, before any byte is read. A load can then read only those
bytes and write them straight into place (`streamload.iter(shard=..., into=...)`).

Anything else done to a stand-in (a transpose, a concatenation, a second copy, a copy into a tensor
that is not a parameter, a parameter rebound or written again, a parameter handed to numpy) makes its
tensor unpredictable: it is then read whole and given to the real function, which does what it does.

The real call then runs under the same watch (`replay`): it is given every name the dry run was
given, in the same order — the placed tensors as the same stand-ins, whose predicted `copy_` is
skipped (the bytes are there already) — so a loader that looks at the names it receives acts alike
in both runs. Whatever the real call does differently (a stand-in copied elsewhere or used another
way, a write into a placed region, a parameter rebound) raises `Diverged` naming the tensors, and the
caller loads them again the ordinary way: never a parameter left different from what the loader
would make of the whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from streamload.shard import Slice

T = TypeVar("T")
Pairs = Iterable[tuple[str, torch.Tensor]]


class Unpredictable(Exception):
    """A stand-in's values were asked for (`item()`, `tolist()`, a truth test): no dry run can answer."""


class Copy(NamedTuple):
    """A tensor's part (None: all of it) lands in `dest`, a view of a parameter."""

    dest: torch.Tensor
    part: Slice | None


@dataclass
class Learned:
    """What a dry run learnt, by checkpoint name."""

    copies: dict[str, Copy] = field(default_factory=dict)  # predictable: read `part`, write into `dest`
    unused: set[str] = field(default_factory=set)  # never copied nor used for values: need not be read at all
    whole: dict[str, str] = field(default_factory=dict)  # unpredictable (why): read whole, give to the real function
    # Placed or unused without a dry run of their own (a layer's twin's, twins.py): the real call is
    # not given them, so the replay cannot hold it to them.
    trusted: set[str] = field(default_factory=set)


# Calls that only describe a tensor (no data, no new tensor): answered by the meta tensor as they are.
_SAME = ("to", "contiguous", "detach", "clone", "data")  # same values: the stand-in goes on as it is
_RESHAPE = ("reshape", "view", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as")
_VALUES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__")


class Diverged(Exception):
    """The real call did not do what its dry run predicted, for `names` ({name: what it did})."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = dict(names)
        listed = "; ".join(f"{n!r}: {why}" for n, why in list(self.names.items())[:5])
        more = f" (and {len(self.names) - 5} more)" if len(self.names) > 5 else ""
        super().__init__(f"the load did not do what its dry run predicted for {listed}{more}")


Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
_Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]  # a view: storage, offset, shape, stride, dtype


def _key(t: torch.Tensor) -> _Key:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _Recorder:
    """What a run does to stand-ins and to real tensors. `expected`: None in a dry run; in a replay,
    the dry run's prediction, held against what the real call does."""

    def __init__(self, params: Iterable[torch.Tensor], expected: Learned | None = None) -> None:
        self.expected = expected
        self.params = [p for p in params if not p.is_meta]
        self.bindings = [_key(p) for p in self.params]  # `param.data = x` changes these
        self.saved = [p.data for p in self.params]
        self.storages = {k[0] for k in self.bindings}
        self.copies: dict[str, list[tuple[torch.Tensor, _StandIn]]] = {}
        self.touched: set[str] = set()
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
                first, end = _span(copy.dest)
                self.landed.setdefault(copy.dest.untyped_storage().data_ptr(), []).append((name, first, end, 0))

    def copied(self, name: str, dest: torch.Tensor, src: _StandIn) -> None:
        if self.expected is not None:
            predicted = self.expected.copies.get(name)
            made = _copy(dest, src)
            if (
                predicted is None
                or made is None
                or made.part != predicted.part
                or _key(made.dest) != _key(predicted.dest)
            ):
                raise Diverged({name: "copied elsewhere than its dry run predicted"})
            self.placed[name] = self.placed.get(name, 0) + 1
            return
        self.copies.setdefault(name, []).append((dest, src))
        if not dest.is_meta:
            first, end = _span(dest)
            self.events += 1
            self.landed.setdefault(dest.untyped_storage().data_ptr(), []).append((name, first, end, self.events))
            self.landed_at[name] = self.events

    def written(self, target: torch.Tensor) -> None:
        """`target` is written by something other than a stand-in's copy."""
        if target.is_meta or isinstance(target, _StandIn):
            return
        storage, (first, end) = target.untyped_storage().data_ptr(), _span(target)
        if self.expected is not None:
            for name, lo, hi, _ in self.landed.get(storage, ()):
                if lo < end and first < hi:
                    self.diverged.setdefault(name, "its region, already filled, is written by the loader")
            return
        self.events += 1
        self.writes.setdefault(storage, []).append((first, end, self.events))

    def escape(self, target: torch.Tensor) -> None:
        """`target`'s memory is handed outside torch (numpy, dlpack): what is written there is unseen."""
        if target.is_meta or isinstance(target, _StandIn):
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
            if _key(p) != key:
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
        first, end = _span(dest)
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


_OPERATORS = (
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "and",
    "or",
    "xor",
    "lshift",
    "rshift",
    "matmul",
)
_IN_PLACE_OPERATORS = {f"__i{op}__" for op in _OPERATORS} | {"__setitem__"}


def _in_place(name: str) -> bool:
    """`copy_`, `fill_`, `mul_`, `t[i] = x`, `t += x`: calls that write their first argument (an aten
    overload's name, `fill_.Scalar`, without its overload)."""
    name = name.split(".", 1)[0]
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__"))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [first, end)."""
    size = t.element_size()
    first = t.storage_offset() * size
    if t.numel() == 0:
        return first, first
    return first, first + (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * size


_ESCAPES = ("numpy", "__array__", "__dlpack__")


class _WriteWatch(torch.overrides.TorchFunctionMode):
    """Sees every torch call of a run, stand-ins or not, to catch writes into the regions copies land
    in. Not called while the stream (not the loader) works in this thread (`Replay.paused`)."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        stand_ins = any(isinstance(a, _StandIn) for a in _flat(args, kwargs))
        if stand_ins and name == "__set__":  # `.data = stand-in` does not reach the subclass by itself
            return _StandIn.__torch_function__(func, types, args, kwargs)
        if not stand_ins:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if first is not None and (_in_place(name) or name == "__set__"):
                self.rec.written(first)
            elif first is not None and name in _ESCAPES:
                self.rec.escape(first)
            out = kwargs.get("out")
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.rec.written(t)
        return func(*args, **kwargs)


_recorder: _Recorder | None = None


class _StandIn(torch.Tensor):
    """A meta tensor standing in for checkpoint tensor `root`, after `narrows` (root dim, start, length).

    `axes` maps each of its dimensions to the root's (None: a dimension of size 1 added by
    `unsqueeze`, `view`, ...); `axes` is None after a reshape that mixes dimensions, when only a copy
    of the whole tensor can still be predicted.
    """

    root: str
    full: tuple[int, ...]
    narrows: tuple[tuple[int, int, int], ...]
    axes: tuple[int | None, ...] | None
    plain: bool  # only narrows and value-preserving calls so far

    @staticmethod
    def make(
        meta: torch.Tensor,
        root: str,
        full: tuple[int, ...],
        narrows: tuple[tuple[int, int, int], ...] = (),
        axes: tuple[int | None, ...] | None = None,
        plain: bool = True,
    ) -> _StandIn:
        t = torch.Tensor._make_subclass(_StandIn, meta)
        t.root, t.full, t.narrows, t.axes, t.plain = root, full, narrows, axes, plain
        return t

    def _like(self, out: torch.Tensor, narrows: tuple[tuple[int, int, int], ...], axes: Any) -> _StandIn:
        return _StandIn.make(out, self.root, self.full, narrows, axes, self.plain)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rec = _recorder
        if rec is None:  # after the dry run: an ordinary meta tensor
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        ins = [a for a in _flat(args, kwargs) if isinstance(a, _StandIn)]
        rec.touched.update(a.root for a in ins)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: `.data` is the same values; `.T`, `.mT`, `.real`, ... are not
            name = "data" if getattr(getattr(func, "__self__", None), "__name__", "") == "data" else "property"
        if name in _VALUES:
            if rec.expected is not None:
                raise Diverged({ins[0].root: f"{name}() asked of it"})
            raise Unpredictable(f"{name}() of {ins[0].root!r}")
        if name == "copy_" and len(args) >= 2:
            dest, src = args[0], args[1]
            if isinstance(src, _StandIn) and not isinstance(dest, _StandIn):
                rec.copied(src.root, dest, src)
                return dest
        if name == "__set__" or (_in_place(name) and not isinstance(args[0], _StandIn)):
            # A real tensor written from a stand-in otherwise than by `copy_` (`index_copy_`, `t[i] = x`,
            # `param.data = x`): not done (the stand-in has no values); the real call does it.
            why = "bound to a parameter (`.data = ...`)" if name == "__set__" else f"{name} from it"
            if rec.expected is not None:
                raise Diverged(dict.fromkeys((a.root for a in ins), why))
            for a in ins:
                rec.tainted.setdefault(a.root, why)
            return None if name == "__set__" else args[0]
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        except Exception as exc:  # in a replay, a stand-in used where its dry run did not: not the model's error
            if rec.expected is not None:
                raise Diverged({a.root: f"{name or func} applied to it" for a in ins}) from exc
            raise
        if not _has_tensor(out):
            return out  # a shape, a dtype, a size: describing is not using
        if len(ins) == 1 and ins[0] is args[0] and (known := ins[0]._follow(name, args, kwargs, out)) is not None:
            return known
        if rec.expected is not None:  # a placed tensor's stand-in used as its dry run did not use it
            raise Diverged({a.root: f"{name or func} applied to it" for a in ins})
        for a in ins:
            rec.tainted.setdefault(a.root, name or str(func))
        return _taint(out, ins)

    def _follow(self, name: str, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        """The stand-in(s) `out` is, when `name` only selects or re-labels elements of this one (with
        the same dtype: a `view(dtype)` reinterprets bits, which a copy into place would not)."""
        axes = self.axes
        outs = out if isinstance(out, (list, tuple)) else (out,)
        if not self.plain or any(not isinstance(o, torch.Tensor) or o.dtype != self.dtype for o in outs):
            return None
        if name in _SAME:
            return self._like(out, self.narrows, axes)
        if name == "narrow" and axes is not None:
            dim, start, length = _narrow_args(args, kwargs)
            dim %= self.dim()
            if axes[dim] is None:
                return self._like(out, self.narrows, axes) if (start, length) == (0, 1) else None
            return self._like(out, (*self.narrows, (axes[dim], start, length)), axes)
        if name == "unbind" and axes is not None:
            dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % self.dim()
            rest = axes[:dim] + axes[dim + 1 :]
            picks = [() if axes[dim] is None else ((axes[dim], i, 1),) for i in range(len(out))]
            return type(out)(self._like(o, (*self.narrows, *p), rest) for o, p in zip(out, picks, strict=True))
        if name in _RESHAPE:
            if axes is not None and _drop_ones(out.shape) == _drop_ones(self.shape):
                kept = iter(a for a, n in zip(axes, self.shape, strict=True) if n != 1)
                return self._like(out, self.narrows, tuple(None if n == 1 else next(kept) for n in out.shape))
            if not self.narrows and out.numel() == self.numel():
                return self._like(out, (), None)  # the whole tensor, reshaped
        return None


def _drop_ones(shape: Any) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _narrow_args(args: Any, kwargs: dict[str, Any]) -> tuple[int, int, int]:
    values = list(args[1:]) + [kwargs[k] for k in ("dim", "start", "length") if k in kwargs]
    dim, start, length = (int(v) for v in values[:3])
    return dim, start, length


def _flat(args: Any, kwargs: dict[str, Any]) -> Iterator[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _has_tensor(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (list, tuple)) and any(isinstance(o, torch.Tensor) for o in out)


def _taint(out: Any, ins: list[_StandIn]) -> Any:
    root = ins[0].root if ins else "?"
    if isinstance(out, torch.Tensor):
        if isinstance(out, _StandIn) or not out.is_meta:
            return out
        return _StandIn.make(out, root, tuple(out.shape), axes=None, plain=False)
    return type(out)(_taint(o, ins) for o in out)


def _stand_in(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> _StandIn:
    return _StandIn.make(torch.empty(shape, dtype=dtype, device="meta"), name, shape, (), tuple(range(len(shape))))


@contextmanager
def _watching(rec: _Recorder) -> Iterator[_WriteWatch]:
    global _recorder
    if _recorder is not None:
        raise RuntimeError("dry runs and replays do not nest")
    _recorder = rec
    try:
        with _WriteWatch(rec) as watch:
            yield watch
    finally:
        _recorder = None


def dry_run(load: Callable[[Pairs], T], tensors: Shapes, params: Iterable[torch.Tensor]) -> tuple[Learned, T]:
    """Call `load` with a stand-in for every checkpoint tensor ({name: (shape, dtype)}, in the order
    the real call will get them) and learn where each goes; copies may land in `params` (a model's
    parameters and buffers) only. Raises `Unpredictable` when `load` needs values; anything else
    `load` raises is its own (a name it does not know, a shape it does not expect) and propagates.

    >>> import torch
    >>> dest = torch.zeros(2, 3)
    >>> def load(pairs):
    ...     for name, t in pairs:
    ...         dest.copy_(t.narrow(0, 2, 2))
    >>> learned, _ = dry_run(load, {"w": ((4, 3), torch.float32)}, [dest])
    >>> learned.copies["w"].part
    Slice(dim=0, start=2, length=2)
    """
    rec = _Recorder(params)
    with _watching(rec):
        result = load((name, _stand_in(name, shape, dtype)) for name, (shape, dtype) in tensors.items())
    moved = rec.rebound()
    learned = Learned()
    for name in tensors:
        copies = rec.copies.get(name, [])
        if name in rec.tainted:
            learned.whole[name] = rec.tainted[name]
        elif len(copies) > 1:
            learned.whole[name] = f"copied {len(copies)} times"
        elif not copies:
            # Never copied and never used for values (that taints): only described or viewed, so no byte
            # of it reaches a parameter (an expert another rank of expert parallelism keeps, whose
            # loader views it before it checks the expert map). The replay holds the real call to that.
            learned.unused.add(name)
        elif (copy := _copy(*copies[0])) is None:
            learned.whole[name] = "not one slice of one dimension copied whole into a parameter"
        elif why := moved.get(copy.dest.untyped_storage().data_ptr()) or rec.verdict(name, copies[0][0]):
            learned.whole[name] = why
        else:
            learned.copies[name] = copy
    return learned, result


class Replay:
    """The real call, watched (`replay`): `stand_in(name)` is what to give it for a placed or unused
    tensor; `paused()` around the stream's own work in this thread."""

    def __init__(self, tensors: Shapes) -> None:
        self._tensors = tensors

    def stand_in(self, name: str) -> torch.Tensor:
        shape, dtype = self._tensors[name]
        return _stand_in(name, shape, dtype)

    @staticmethod
    def paused() -> Any:
        """No torch-function handling at all (the watch, subclasses): the stream's own writes into
        place are not the loader's, and a per-call hook costs the stream microseconds a call."""
        return torch._C.DisableTorchFunction()


@contextmanager
def replay(learned: Learned, tensors: Shapes, params: Iterable[torch.Tensor]) -> Iterator[Replay]:
    """Run the real call of a dry-run `learned` under the same watch. Feed it every name of `tensors`
    but `learned.trusted`, in the dry run's order: `Replay.stand_in(name)` for each name in `learned.copies` (its bytes
    already in place) and `learned.unused`, the real tensor for the others. On leaving, raises
    `Diverged` if the call did anything the dry run did not predict: a placed tensor not copied
    exactly once to its predicted view, used otherwise, an unused one copied or used for values, a placed region
    written or handed to numpy, its parameter rebound.

    >>> import torch
    >>> dest = torch.zeros(3)
    >>> def load(pairs):
    ...     for name, t in pairs:
    ...         dest.copy_(t)
    >>> learned, _ = dry_run(load, {"w": ((3,), torch.float32)}, [dest])
    >>> dest.fill_(7.0)  # the stream put the bytes in place
    tensor([7., 7., 7.])
    >>> with replay(learned, {"w": ((3,), torch.float32)}, [dest]) as run:
    ...     load([("w", run.stand_in("w"))])
    >>> dest
    tensor([7., 7., 7.])
    """
    rec = _Recorder(params, expected=learned)
    with _watching(rec):
        yield Replay(tensors)
    for name in learned.copies.keys() - learned.trusted:
        if rec.placed.get(name, 0) != 1:
            rec.diverged.setdefault(name, f"copied {rec.placed.get(name, 0)} times, its dry run once")
    moved = rec.rebound()
    for name, copy in learned.copies.items():
        if why := moved.get(copy.dest.untyped_storage().data_ptr()):
            rec.diverged.setdefault(name, why)
    if rec.diverged:
        raise Diverged(rec.diverged)


def _copy(dest: torch.Tensor, src: _StandIn) -> Copy | None:
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
