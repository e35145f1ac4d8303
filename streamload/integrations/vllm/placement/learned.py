"""What a dry run learns (`Learned`: where each checkpoint tensor's part lands, `Copy`) and the two ways
a run can fail it: values asked of a stand-in (`Unpredictable`), a real call unlike its dry run (`Diverged`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from streamload.plan.shard import Slice

Pairs = Iterable[tuple[str, torch.Tensor]]
Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


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


class Diverged(Exception):
    """The real call did not do what its dry run predicted, for `names` ({name: what it did})."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = dict(names)
        listed = "; ".join(f"{n!r}: {why}" for n, why in list(self.names.items())[:5])
        more = f" (and {len(self.names) - 5} more)" if len(self.names) > 5 else ""
        super().__init__(f"the load did not do what its dry run predicted for {listed}{more}")
