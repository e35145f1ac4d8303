"""ShardSpec: which part of each tensor a rank keeps, and which bytes of the file that part is."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from streamload.base.argument_checks import described

SKIP = "skip"  # a rule's answer for a tensor this rank does not keep at all (an expert it does not own)
Dim = int | str | None  # a split dimension, None (replicate) or SKIP
Rules = Mapping[str, Dim] | Callable[[str, tuple[int, ...]], "Dim | Slice"]


@dataclass(frozen=True)
class Slice:
    """Rank's part of a tensor: `torch.tensor_split(full, world_size, dim)[rank]`."""

    dim: int
    start: int
    length: int

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        """The part's shape in a tensor of shape `full`."""
        return (*full[: self.dim], self.length, *full[self.dim + 1 :])


@dataclass(frozen=True)
class ShardSpec:
    """How tensors are split over ranks.

    `rules` maps fnmatch patterns to a dimension (`None`: replicate, `ShardSpec.SKIP`: not kept),
    first match wins, unmatched tensors are replicated; or it is a callable `(name, shape) -> dim`,
    which may also answer with the exact `Slice` the rank keeps (a server's own partitioning).
    `rank` and `world_size` default to torch.distributed's once it is initialised.

    `full_shape=True` hands each tensor out in its full shape with only the rank's part read and
    written (the rest uninitialised; on the CPU's mapping reader, a view of the file whose other pages
    are not read): for consumers that narrow tensors themselves, as vLLM's weight loaders do.

    >>> tp = ShardSpec({"*.q_proj.weight": 0, "*.o_proj.weight": 1, "*embed_tokens*": 0}, rank=1, world_size=2)
    >>> tp.slice("model.layers.0.o_proj.weight", (4096, 4096))
    Slice(dim=1, start=2048, length=2048)
    """

    rules: Rules
    rank: int | None = None
    world_size: int | None = None
    full_shape: bool = False
    SKIP = SKIP

    def __post_init__(self) -> None:  # (a bad rule fails here, not deep in a load)
        if callable(self.rules):
            return
        if not isinstance(self.rules, Mapping):
            raise TypeError(
                "ShardSpec rules must be a mapping of fnmatch patterns to a dimension, None or ShardSpec.SKIP "
                f"(e.g. {{'*.q_proj.weight': 0}}), or a callable (name, shape) -> dim, not {described(self.rules)}"
            )
        for pattern, dim in self.rules.items():
            if not isinstance(pattern, str):
                raise TypeError(f"ShardSpec rule {pattern!r}: patterns must be text, not {type(pattern).__name__}")
            if not (dim is None or dim == SKIP or (isinstance(dim, int) and not isinstance(dim, bool))):
                raise TypeError(
                    f"ShardSpec rule {pattern!r}: {described(dim)} is not a dimension (an int), None or ShardSpec.SKIP"
                )

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The patterns of a mapping's rules that match none of `names` (a mistyped rule is
        otherwise silently a replicated tensor); none for a callable's."""
        if callable(self.rules):
            return []
        left = list(self.rules)
        for name in names:
            left = [p for p in left if not fnmatch.fnmatchcase(name, p)]
            if not left:
                break
        return left

    def resolved(self) -> ShardSpec:
        """This spec with rank and world size filled in (from torch.distributed when not given)."""
        rank, world = self.rank, self.world_size
        if rank is None or world is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("ShardSpec needs rank and world_size, or an initialised torch.distributed")
            rank = dist.get_rank() if rank is None else rank
            world = dist.get_world_size() if world is None else world
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of size {world}")
        return ShardSpec(self.rules, rank, world, self.full_shape)

    def dim(self, name: str, shape: tuple[int, ...]) -> Dim | Slice:
        if callable(self.rules):
            return self.rules(name, shape)
        return next((d for pat, d in self.rules.items() if fnmatch.fnmatchcase(name, pat)), None)

    def slice(self, name: str, shape: tuple[int, ...]) -> Slice | str | None:
        """This rank's slice of a tensor, None to keep it whole, or SKIP."""
        dim = self.dim(name, shape)
        if isinstance(dim, Slice):  # the rule's own slice: checked, so that it never reads a neighbour's bytes
            d = dim.dim % len(shape) if -len(shape) <= dim.dim < len(shape) else None
            if d is None or dim.start < 0 or dim.length < 0 or dim.start + dim.length > shape[d]:
                raise ValueError(f"tensor {name!r} of shape {list(shape)}: {dim} is not a slice of it")
            return Slice(d, dim.start, dim.length)
        if dim is None or dim == SKIP:
            return dim
        assert self.rank is not None and self.world_size is not None, "call resolved() first"
        if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise ValueError(f"tensor {name!r} of shape {list(shape)}: cannot split on dimension {dim!r}")
        dim %= len(shape)
        base, extra = divmod(shape[dim], self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return Slice(dim, start, base + (self.rank < extra))


def byte_ranges(begin: int, shape: tuple[int, ...], itemsize: int, part: Slice) -> list[tuple[int, int]]:
    """(file offset, length) ranges whose concatenation is the row-major bytes of `part`.

    A split on dim 0 (or after leading dims of size 1) is one range; a later dim gives one range
    per row of the dims before it, each skipping the other ranks' columns.
    """
    inner = math.prod(shape[part.dim + 1 :]) * itemsize
    outer = math.prod(shape[: part.dim])
    block, stride = part.length * inner, shape[part.dim] * inner
    first = begin + part.start * inner
    if outer == 1:
        return [(first, block)]
    return [(first + k * stride, block) for k in range(outer)]
