"""A dry run of a weight-loading function: which part of each checkpoint tensor it copies where.

Servers fill their parameters through loader functions that narrow each checkpoint tensor to the
rank's part and `copy_` it into (a view of) a parameter, e.g. vLLM's `model.load_weights`. Calling
such a function with stand-ins — meta tensors of the checkpoint's shapes that record the `narrow`s
applied to them and the `copy_` that consumes them, copying nothing — tells which bytes of each
tensor this rank keeps and where they go, before any byte is read. A load can then read only those
bytes and write them straight into place (`streamload.iter(shard=..., into=...)`).

Anything else done to a stand-in (a transpose, a concatenation, a second copy) makes its tensor
unpredictable: it is then read whole and given to the real function, which does what it does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from .shard import Slice

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
    unused: set[str] = field(default_factory=set)  # never looked at: need not be read at all
    whole: dict[str, str] = field(default_factory=dict)  # unpredictable (why): read whole, give to the real function


# Calls that only describe a tensor (no data, no new tensor): answered by the meta tensor as they are.
_SAME = ("to", "contiguous", "detach", "clone", "data")  # same values: the stand-in goes on as it is
_RESHAPE = ("reshape", "view", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as")
_VALUES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__")


class _Recorder:
    def __init__(self) -> None:
        self.copies: dict[str, list[tuple[torch.Tensor, _StandIn]]] = {}
        self.touched: set[str] = set()
        self.tainted: dict[str, str] = {}  # name -> the first call that made it unpredictable
        self.landed: dict[int, list[tuple[str, int, int]]] = {}  # storage -> (name, first byte, end) copied there

    def copied(self, name: str, dest: torch.Tensor, src: _StandIn) -> None:
        self.copies.setdefault(name, []).append((dest, src))
        if not dest.is_meta:
            first, end = _span(dest)
            self.landed.setdefault(dest.untyped_storage().data_ptr(), []).append((name, first, end))

    def written(self, target: torch.Tensor) -> None:
        """`target` is written after copies landed: a copy it overlaps would be overwritten (a loader that
        post-processes its parameter in place, e.g. `param.copy_(fn(param))`), so it cannot go first."""
        if target.is_meta or isinstance(target, _StandIn):
            return
        first, end = _span(target)
        for name, lo, hi in self.landed.get(target.untyped_storage().data_ptr(), ()):
            if lo < end and first < hi:
                self.tainted.setdefault(name, "its parameter is written again after the copy")


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
    """`copy_`, `fill_`, `mul_`, `t[i] = x`, `t += x`: calls that write their first argument."""
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__"))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [first, end)."""
    size = t.element_size()
    first = t.storage_offset() * size
    if t.numel() == 0:
        return first, first
    return first, first + (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * size


class _WriteWatch(torch.overrides.TorchFunctionMode):
    """Sees every torch call of the dry run, stand-ins or not, to catch writes into landed copies."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not any(isinstance(a, _StandIn) for a in _flat(args, kwargs)):
            if _in_place(name) and args and isinstance(args[0], torch.Tensor):
                self.rec.written(args[0])
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
            raise Unpredictable(f"{name}() of {ins[0].root!r}")
        if name == "copy_" and len(args) >= 2:
            dest, src = args[0], args[1]
            if isinstance(src, _StandIn) and not isinstance(dest, _StandIn):
                rec.copied(src.root, dest, src)
                return dest
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not _has_tensor(out):
            return out  # a shape, a dtype, a size: describing is not using
        if len(ins) == 1 and ins[0] is args[0] and (known := ins[0]._follow(name, args, kwargs, out)) is not None:
            return known
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


def dry_run(
    load: Callable[[Pairs], T], tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[Learned, T]:
    """Call `load` with a stand-in for every checkpoint tensor ({name: (shape, dtype)}) and learn
    where each goes. Raises `Unpredictable` when `load` needs values; anything else `load` raises
    is its own (a name it does not know, a shape it does not expect) and propagates.

    >>> import torch
    >>> dest = torch.zeros(2, 3)
    >>> def load(pairs):
    ...     for name, t in pairs:
    ...         dest.copy_(t.narrow(0, 2, 2))
    >>> learned, _ = dry_run(load, {"w": ((4, 3), torch.float32)})
    >>> learned.copies["w"].part
    Slice(dim=0, start=2, length=2)
    """
    global _recorder
    if _recorder is not None:
        raise RuntimeError("dry runs do not nest")
    rec = _recorder = _Recorder()
    try:
        stand_ins = (
            (
                name,
                _StandIn.make(
                    torch.empty(shape, dtype=dtype, device="meta"), name, shape, (), tuple(range(len(shape)))
                ),
            )
            for name, (shape, dtype) in tensors.items()
        )
        with _WriteWatch(rec):
            result = load(stand_ins)
    finally:
        _recorder = None
    learned = Learned()
    for name in tensors:
        copies = rec.copies.get(name, [])
        if name in rec.tainted:
            learned.whole[name] = rec.tainted[name]
        elif len(copies) > 1:
            learned.whole[name] = f"copied {len(copies)} times"
        elif not copies:
            if name in rec.touched:
                learned.whole[name] = "looked at but never copied"
            else:
                learned.unused.add(name)
        elif (copy := _copy(*copies[0])) is None:
            learned.whole[name] = "not one slice of one dimension copied whole into a parameter"
        else:
            learned.copies[name] = copy
    return learned, result


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
