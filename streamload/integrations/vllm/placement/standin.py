"""Stand-ins (`StandIn`): meta tensors of a checkpoint tensor's shape that record the `narrow`s and
reshapes applied to them and the `copy_` that consumes them, copying nothing; and the watch
(`WriteWatch`) that sees every other torch call of a run, to catch writes into the regions copies land
in. Both report to a `Watcher` (recorder.py's `Recorder`: a protocol here, since it imports `StandIn`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from streamload.integrations.vllm.placement.learned import Diverged, Learned, Unpredictable


class Watcher(Protocol):
    expected: Learned | None  # None in a dry run; in a replay, the dry run's prediction
    tainted: dict[str, str]  # name -> the first call that made it unpredictable

    def copied(self, name: str, dest: torch.Tensor, src: StandIn) -> None: ...

    def written(self, target: torch.Tensor) -> None: ...

    def escape(self, target: torch.Tensor) -> None: ...


# Calls that only describe a tensor (no data, no new tensor): answered by the meta tensor as they are.
_SAME = ("to", "contiguous", "detach", "clone", "data")  # same values: the stand-in goes on as it is
_RESHAPE = ("reshape", "view", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as")
_VALUES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__")
_OPERATORS = "add sub mul truediv floordiv mod pow and or xor lshift rshift matmul".split()
_IN_PLACE_OPERATORS = {f"__i{op}__" for op in _OPERATORS} | {"__setitem__"}


def _in_place(name: str) -> bool:
    """`copy_`, `fill_`, `mul_`, `t[i] = x`, `t += x`: calls that write their first argument (an aten
    overload's name, `fill_.Scalar`, without its overload)."""
    name = name.split(".", 1)[0]
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__"))


_ESCAPES = ("numpy", "__array__", "__dlpack__")


class WriteWatch(torch.overrides.TorchFunctionMode):
    """Sees every torch call of a run, stand-ins or not, to catch writes into the regions copies land
    in. Not called while the stream (not the loader) works in this thread (`Replay.paused`)."""

    def __init__(self, rec: Watcher) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        stand_ins = any(isinstance(a, StandIn) for a in flat(args, kwargs))
        if stand_ins and name == "__set__":  # `.data = stand-in` does not reach the subclass by itself
            return StandIn.__torch_function__(func, types, args, kwargs)
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


_recorder: Watcher | None = None


class StandIn(torch.Tensor):
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
    ) -> StandIn:
        t = torch.Tensor._make_subclass(StandIn, meta)
        t.root, t.full, t.narrows, t.axes, t.plain = root, full, narrows, axes, plain
        return t

    def _like(self, out: torch.Tensor, narrows: tuple[tuple[int, int, int], ...], axes: Any) -> StandIn:
        return StandIn.make(out, self.root, self.full, narrows, axes, self.plain)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rec = _recorder
        if rec is None:  # after the dry run: an ordinary meta tensor
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        ins = [a for a in flat(args, kwargs) if isinstance(a, StandIn)]
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: `.data` is the same values; `.T`, `.mT`, `.real`, ... are not
            name = "data" if getattr(getattr(func, "__self__", None), "__name__", "") == "data" else "property"
        if name in _VALUES:
            if rec.expected is not None:
                raise Diverged({ins[0].root: f"{name}() asked of it"})
            raise Unpredictable(f"{name}() of {ins[0].root!r}")
        if name == "copy_" and len(args) >= 2:
            dest, src = args[0], args[1]
            if isinstance(src, StandIn) and not isinstance(dest, StandIn):
                rec.copied(src.root, dest, src)
                return dest
        if name == "__set__" or (_in_place(name) and not isinstance(args[0], StandIn)):
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


def flat(args: Any, kwargs: dict[str, Any]) -> Iterator[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _has_tensor(out: Any) -> bool:
    return isinstance(out, torch.Tensor) or (
        isinstance(out, (list, tuple)) and any(isinstance(o, torch.Tensor) for o in out)
    )


def _taint(out: Any, ins: list[StandIn]) -> Any:
    root = ins[0].root if ins else "?"
    if isinstance(out, torch.Tensor):
        if isinstance(out, StandIn) or not out.is_meta:
            return out
        return StandIn.make(out, root, tuple(out.shape), axes=None, plain=False)
    return type(out)(_taint(o, ins) for o in out)


def stand_in(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> StandIn:
    return StandIn.make(torch.empty(shape, dtype=dtype, device="meta"), name, shape, (), tuple(range(len(shape))))


@contextmanager
def watching(rec: Watcher) -> Iterator[WriteWatch]:
    """One run (a dry run or a replay) recorded by `rec`. Runs do not nest."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("dry runs and replays do not nest")
    _recorder = rec
    try:
        with WriteWatch(rec) as watch:
            yield watch
    finally:
        _recorder = None
