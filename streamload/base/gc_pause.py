"""The cyclic garbage collector held off while a load makes its per-tensor objects.

Headers, plans and a batch's tensors are tens of thousands of small objects that all live on; left to
the collector, making them sets off full collections that walk every object of the process (two of
83 ms each while loading an 18,867-tensor checkpoint in 0.41 s, with torch imported). Held off for
those calls only, the objects are collected as the process goes on, not on the load's clock. The
vLLM format holds it off for its whole `load_weights` (a many-tensor model's placement is tens of
thousands of views; full collections over vLLM's heap were 0.46 s of a 1.4 s load): cyclic garbage
made during that call, device tensors included, is freed when it returns.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def collector_paused(call: Callable[P, T]) -> Callable[P, T]:
    """`call` with the collector off while it runs (and on again after, if it was on before)."""

    @functools.wraps(call)
    def paused(*args: P.args, **kwargs: P.kwargs) -> T:
        if not gc.isenabled():
            return call(*args, **kwargs)
        gc.disable()
        try:
            return call(*args, **kwargs)
        finally:
            gc.enable()

    return paused
