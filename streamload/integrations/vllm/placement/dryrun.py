"""A dry run of a weight-loading function: which part of each checkpoint tensor it copies where, and a
watched replay of the real call that proves the prediction held.

Loaders such as vLLM's `model.load_weights` narrow each checkpoint tensor to the rank's part and
`copy_` it into (a view of) a parameter. Called with stand-ins (meta tensors that record the `narrow`s
applied to them and the `copy_` that consumes them), such a function tells which bytes of each tensor
this rank keeps and where they go before any byte is read; the load then reads only those bytes,
straight into place. Anything else done to a stand-in makes its tensor unpredictable: it is read whole
and given to the real function.

The real call is given every name the dry run was given, in the same order (the placed tensors as the
same stand-ins, their predicted `copy_` skipped), so a loader that looks at the names acts alike in both
runs. Whatever it does differently raises `Diverged`, and the caller loads those tensors again the
ordinary way: never a parameter left different from what the loader would make of the whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from streamload.integrations.vllm.placement.learned import Copy, Diverged, Learned, Pairs, Shapes, Unpredictable
from streamload.integrations.vllm.placement.recorder import Recorder, copy_of
from streamload.integrations.vllm.placement.standin import stand_in, watching

T = TypeVar("T")


def dry_run(load: Callable[[Pairs], T], tensors: Shapes, params: Iterable[torch.Tensor]) -> tuple[Learned, T]:
    """Call `load` with a stand-in for every checkpoint tensor ({name: (shape, dtype)}, in the order
    the real call will get them) and learn where each goes; copies may land in `params` only. What
    `load` raises is its own (a name it does not know, a shape it does not expect) and propagates."""
    rec = Recorder(params)
    with watching(rec):
        result = load((name, stand_in(name, shape, dtype)) for name, (shape, dtype) in tensors.items())
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
        elif (copy := copy_of(*copies[0])) is None:
            learned.whole[name] = "not one slice of one dimension copied whole into a parameter"
        elif why := moved.get(copy.dest.untyped_storage().data_ptr()) or rec.verdict(name, copies[0][0]):
            learned.whole[name] = why
        else:
            learned.copies[name] = copy
    return learned, result


class Replay:
    """The real call, watched (`replay`): `stand_in(name)` is what to give it for a placed or unused
    tensor."""

    def __init__(self, tensors: Shapes) -> None:
        self._tensors = tensors

    def stand_in(self, name: str) -> torch.Tensor:
        shape, dtype = self._tensors[name]
        return stand_in(name, shape, dtype)

    @staticmethod
    def paused() -> Any:
        """No torch-function handling at all (the watch, subclasses): the stream's own writes into
        place are not the loader's, and a per-call hook costs the stream microseconds a call."""
        return torch._C.DisableTorchFunction()


@contextmanager
def replay(learned: Learned, tensors: Shapes, params: Iterable[torch.Tensor]) -> Iterator[Replay]:
    """Run the real call of a dry-run `learned` under the same watch. Feed it every name of `tensors`
    but `learned.trusted`, in the dry run's order: `Replay.stand_in(name)` for the placed and unused
    ones, the real tensor for the others. On leaving, raises `Diverged` if the call did anything the
    dry run did not predict."""
    rec = Recorder(params, expected=learned)
    with watching(rec):
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


__all__ = ["Copy", "Diverged", "Learned", "Pairs", "Replay", "Shapes", "Unpredictable", "dry_run", "replay"]
