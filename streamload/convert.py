"""Converting while streaming: where each source tensor's bytes land in the model's tensors.

A `Conversion` is data: for each checkpoint tensor it converts, the model tensor it lands in (its
target) and the region of the target it fills, as a few view steps (`select`, `narrow`,
`transpose`). A rename is a region with no steps; a merge of a module list into one tensor gives each
source a `select` along the new dimension; a concatenation a `narrow`. A target filled by several
sources is allocated once, where the model's tensors go, and each source is read straight into its
region (`iter(into=...)`): no source is gathered, stacked or copied again. Frameworks build the data
from their own conversion rules (`integrations/transformers.py`: transformers 5's); `load_into(...,
conversion=...)` executes it.

>>> import torch
>>> c = Conversion.merge("experts.w", [f"experts.{e}.w" for e in range(2)], (4, 3))
>>> c.target_of("experts.1.w"), c.shapes["experts.w"]
('experts.w', (2, 4, 3))
>>> c.regions["experts.1.w"].of(torch.arange(24).reshape(2, 4, 3))[0].tolist()
[12, 13, 14]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .errors import UnsupportedError

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
