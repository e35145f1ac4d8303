"""What the last load in this process did (`last_load`): for logs, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamload.integrations.vllm.placement.learned import Learned

if TYPE_CHECKING:
    from streamload.base.stats import Stats
    from streamload.integrations.vllm.files import Part


@dataclass
class Report:
    seconds: float = 0.0
    plan_seconds: float = 0.0  # of which: headers and the dry run, before the first byte is read
    bytes_read: int = 0
    reader: str = ""  # the reader the streams used ("mmap", "posix", "kvikio", "range", ...)
    bytes_total: int = 0  # the whole checkpoint
    direct: int = 0  # tensors written straight into their parameters
    by_twin: int = 0  # of which placed as a dry-run layer's twin (placement/twins.py)
    through_model: int = 0  # tensors read whole and given to the model's load_weights
    unused: int = 0  # tensors the model does not use: never read
    bytes_fair: int = 0  # 1/world of each tensor the ranks split plus every other tensor read: the goal
    staged: str = ""  # where the first load read weights fetched while the engine started (startup/ahead.py)
    compile_cache: str = ""  # what the first load did with compiled artifacts published beside the weights
    seeding: str = ""  # where this node seeds cache_dir since its first load began ("seed": seeding.py)
    why_whole: dict[str, str] = field(default_factory=dict)  # a few unpredicted tensors, and why
    diverged: dict[str, str] = field(default_factory=dict)  # what the real call did unlike its dry run (then redone)


last_load = Report()


def record(parts: list[Part], stats: list[Stats], learned: Learned | None, world: int) -> None:
    """`last_load`, from the streams' stats of this load (a load that diverged and was redone: both)."""
    learned = learned or Learned()  # nothing placed: every tensor read whole
    last_load.bytes_read = sum(s.bytes_read for s in stats)
    last_load.reader = ", ".join(dict.fromkeys(s.reader for s in stats))
    last_load.bytes_total = sum(part.checkpoint.nbytes for part in parts if part.checkpoint is not None)
    every = [name for part in parts for name in (*part.names, *(n for n, _ in part.others))]
    last_load.direct = len(learned.copies)
    last_load.unused = len(learned.unused)
    last_load.by_twin = len(learned.trusted - learned.unused)
    last_load.through_model = len(every) - last_load.direct - last_load.unused
    split = {n for n, c in learned.copies.items() if c.part is not None}
    last_load.bytes_fair = sum(
        t.nbytes // world if n in split else t.nbytes
        for p in parts
        for n, t in p.names.items()
        if n not in learned.unused
    )
    last_load.why_whole = dict(list(learned.whole.items())[:3])
