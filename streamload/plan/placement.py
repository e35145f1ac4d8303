"""Converting while streaming: where each source tensor's bytes land in the model's tensors.

A `Conversion` is data: for each checkpoint tensor it converts, its target (the model tensor it lands
in) and the region of the target it fills, as a few view steps (`select`, `narrow`, `transpose`): a
rename has none, a module list merged into one tensor gives each source a `select`, a concatenation a
`narrow`. A target several sources fill is allocated once, where the model's tensors go, and each
source is read straight into its region (`iter(into=...)`): nothing is gathered, stacked or copied
again. Frameworks build the data from their own rules (`integrations/transformers.py`);
`load_into(..., conversion=...)` executes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from streamload.base.errors import UnsupportedError
from streamload.plan.shard import SKIP, ShardSpec, Slice

# ("select", dim, index, 0), ("narrow", dim, start, length) or ("transpose", dim0, dim1, 0)
Step = tuple[str, int, int, int]


@dataclass(frozen=True)
class Region:
    """The part of `target` one source fills: `steps` applied in order to the target tensor."""

    target: str
    steps: tuple[Step, ...] = ()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of `tensor` (the target) this source is written into."""
        for kind, a, b, c in self.steps:
            if kind == "select":
                tensor = tensor.select(a, b)
            elif kind == "narrow":
                tensor = tensor.narrow(a, b, c)
            else:
                tensor = tensor.transpose(a, b)
        return tensor

    def shape_in(self, target_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the region inside a target of `target_shape` (no tensor needed)."""
        shape = list(target_shape)
        for kind, a, b, c in self.steps:
            if kind == "select":
                del shape[a]
            elif kind == "narrow":
                shape[a] = c
            else:
                shape[a], shape[b] = shape[b], shape[a]
        return tuple(shape)


@dataclass
class Conversion:
    """Checkpoint names -> the regions of model tensors they fill. `shapes` holds the shape of each
    target filled by several sources (allocated by the loader); renamed targets keep their source's."""

    regions: dict[str, Region] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @staticmethod
    def rename(pairs: Mapping[str, str]) -> Conversion:
        """Sources renamed, nothing else: {source: target}."""
        return Conversion({s: Region(t) for s, t in pairs.items()})

    @staticmethod
    def merge(target: str, sources: Sequence[str], shape: Sequence[int], dim: int = 0) -> Conversion:
        """Sources of one `shape` stacked along a new `dim` of `target` (a module list made one tensor)."""
        full = (*shape[:dim], len(sources), *shape[dim:])
        return Conversion({s: Region(target, (("select", dim, i, 0),)) for i, s in enumerate(sources)}, {target: full})

    def __or__(self, other: Conversion) -> Conversion:
        return Conversion({**self.regions, **other.regions}, {**self.shapes, **other.shapes})

    def target_of(self, name: str) -> str:
        region = self.regions.get(name)
        return name if region is None else region.target

    def fused(self) -> dict[str, list[str]]:
        """Each target several sources fill: its sources, in checkpoint-name order."""
        out: dict[str, list[str]] = {t: [] for t in self.shapes}
        for source, region in self.regions.items():
            if region.target in out:
                out[region.target].append(source)
        return out

    def check(self, shapes: Mapping[str, Sequence[int]], what: str = "the checkpoint") -> None:
        """That every fused target is covered exactly once by its sources' regions, each region of
        its source's shape (`shapes`: the stored shape of every source present); raises before a byte
        is read."""
        for target, sources in self.fused().items():
            sources = [s for s in sources if s in shapes]
            size = math.prod(self.shapes[target])
            covered = 0
            for s in sources:
                want = self.regions[s].shape_in(self.shapes[target])
                got = tuple(shapes[s])
                if want != got:
                    raise UnsupportedError(f"{what}: {s!r} has shape {list(got)}, its place in {target!r} {list(want)}")
                covered += math.prod(got)
            if covered != size:
                raise UnsupportedError(
                    f"{what}: {target!r} ({list(self.shapes[target])}) is filled by {len(sources)} tensors "
                    f"of {covered} elements in all, not {size}"
                )

    def targets(self, names: Iterable[str]) -> set[str]:
        return {self.target_of(n) for n in names}

    def views(self, wholes: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each source's region of its target in `wholes` (targets several sources fill): what it is read into."""
        return {s: r.of(wholes[r.target]) for s, r in self.regions.items() if r.target in wholes}

    def only(self, names: Iterable[str]) -> Conversion:
        """The part of this conversion that converts `names` (a block, the tensors a load includes)."""
        regions = {n: r for n in names if (r := self.regions.get(n)) is not None}
        targets = {r.target for r in regions.values()}
        return Conversion(regions, {t: shape for t, shape in self.shapes.items() if t in targets})

    def sharded(self, spec: ShardSpec, shapes: Mapping[str, Sequence[int]]) -> tuple[Conversion, ShardSpec]:
        """This rank's conversion under `spec`, whose rules name the model's tensors (the targets),
        and the spec for the checkpoint's tensors that reads each source's part of the rank's part.

        The rank keeps `tensor_split(target, world_size, dim)[rank]` of every target, whether the
        checkpoint stores it whole or in pieces: a split over a merged dimension (experts) keeps the
        rank's sources whole and reads no other's; a split crossing concatenated pieces reads each
        piece's overlap with the rank's part. Fused targets get the rank's shape; `shapes`: the stored
        shape of every source present.

        >>> c = Conversion.merge("w", ["w.0", "w.1", "w.2", "w.3"], (2, 3))
        >>> mine, spec = c.sharded(ShardSpec({"w": 0}, rank=1, world_size=2), {f"w.{e}": (2, 3) for e in range(4)})
        >>> mine.shapes["w"], sorted(mine.regions), spec.slice("w.0", (2, 3))
        ((2, 2, 3), ['w.2', 'w.3'], 'skip')
        """
        spec = spec.resolved()
        regions: dict[str, Region] = {}
        local: dict[str, tuple[int, ...]] = {}
        answers: dict[str, Slice | str | None] = {}
        for source, region in self.regions.items():
            if source not in shapes:
                continue
            full = self.shapes.get(region.target, tuple(shapes[source]))
            part = spec.slice(region.target, full)
            if region.target in self.shapes and part != SKIP:
                local[region.target] = part.shape(full) if isinstance(part, Slice) else full
            if not isinstance(part, Slice):  # whole, or not kept at all
                answers[source] = part
                if part is None:
                    regions[source] = region
                continue
            placed = _within(region.steps, part, tuple(shapes[source]))
            if placed is None:
                answers[source] = SKIP
            else:
                answers[source], regions[source] = placed[0], Region(region.target, placed[1])

        def rule(name: str, shape: tuple[int, ...]) -> Slice | str | int | None:
            return answers[name] if name in answers else spec.dim(name, shape)  # type: ignore[return-value]

        return Conversion(regions, local), ShardSpec(rule, spec.rank, spec.world_size, spec.full_shape)


Placed = tuple[Slice | None, tuple[Step, ...]]


def _within(steps: Sequence[Step], part: Slice, source: tuple[int, ...]) -> Placed | None:
    """A source's region `steps` (in the whole target) made this rank's: (the part of the source to
    read, None for all of it; the steps of its region in the rank's part of the target), or None
    where the source lies outside the rank's part. The split dimension is followed through the
    steps, with the rank's interval in the coordinates of the view at hand; in the rank's tensor,
    coordinate 0 of that dimension is always the interval's start."""
    dim: int | None = part.dim
    low, high = part.start, part.start + part.length
    out: list[Step] = []
    for kind, a, b, c in steps:
        if dim is None:  # the split dimension is resolved: the rest as it is
            out.append((kind, a, b, c))
        elif kind == "select":
            if a == dim:
                if not low <= b < high:
                    return None
                out.append(("select", a, b - low, 0))
                dim = None
            else:
                dim -= a < dim
                out.append((kind, a, b, c))
        elif kind == "narrow":
            if a == dim:
                start, end = max(low, b), min(high, b + c)
                if end <= start:
                    return None
                out.append(("narrow", a, start - low, end - start))
                low, high = start - b, end - b
            else:
                out.append((kind, a, b, c))
        else:  # transpose
            dim = b if a == dim else a if b == dim else dim
            out.append((kind, a, b, c))
    if dim is None or high - low == source[dim]:
        return None, tuple(out)
    return Slice(dim, low, high - low), tuple(out)
