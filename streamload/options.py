"""The keyword options of `iter`, declared once (`TABLE`): how each is checked, and which a plain config
carries. The rest derive from it: `Options` (the `**options` that `load`, `layers`, `load_into`,
`from_pretrained` and `offload` pass on to `iter`), `ReadOptions` (how a stream reads) and `CONFIG`
(the options vLLM's `model_loader_extra_config` passes on to `iter`).

>>> check("ring_bytes", "1GiB")
1073741824
>>> CONFIG["threads"]
<class 'int'>
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, TypeVar

from streamload.base import argument_checks, tuning

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from streamload.cooperative.fleet import Fleet
    from streamload.pipeline.reader_choice import ReaderName
    from streamload.pipeline.verify import Verify
    from streamload.plan.checkpoint import PathLike
    from streamload.plan.plan import DTypeOption, Order, Patterns
    from streamload.plan.shard import ShardSpec

T = TypeVar("T")


def _checked_where_used(value: T, name: str) -> T:
    """For an option whose check needs what a load finds: `device.resolve` the device, `reader_choice.route`
    the reader, `plan.make_plan` dtype and order, `api` cooperative, `source.open_checkpoint` cache_dir
    (a `Checkpoint` from `inspect` needs none)."""
    return value


def _shard(value: T, name: str = "shard") -> T:
    if value is None:
        return value  # plan/shard.py is imported only by those who shard
    from streamload.plan.shard import ShardSpec

    if not isinstance(value, ShardSpec):
        raise TypeError(f"{name} must be a streamload.ShardSpec, not {argument_checks.described(value)}")
    return value


class Option(NamedTuple):
    """One keyword option of `iter`."""

    name: str
    check: Callable[[Any, str], Any]  # the value checked (TypeError, ValueError naming it) and normalised
    config: type | tuple[type, ...] | None = None  # its types in a JSON config (vLLM's); None: no config carries it


# In the order `iter` checks them (which error a call with two bad options gets).
TABLE: dict[str, Option] = {
    option.name: option
    for option in (
        Option("device", _checked_where_used),
        Option("dtype", _checked_where_used),
        Option("reader", _checked_where_used, str),
        Option("ring_bytes", argument_checks.size, (int, str)),  # bytes, or with a unit: "1GiB"
        Option("chunk_bytes", argument_checks.size, (int, str)),
        Option("threads", argument_checks.count, int),
        Option("slots", argument_checks.count, int),
        Option("include", argument_checks.patterns),
        Option("exclude", argument_checks.patterns),
        Option("into", argument_checks.into),
        Option("shard", _shard),
        Option("verify", argument_checks.verify, (bool, dict)),
        Option("order", _checked_where_used),
        Option("cooperative", _checked_where_used),  # a process group: vLLM's config has a switch of its own
        Option("cache_dir", _checked_where_used, str),
        Option("peers", argument_checks.peers, (str, list)),  # nodes seeding the files (storage/peers.py)
    )
}
# The options a JSON config carries as `iter` takes them, and their types there (vLLM's loader passes
# these on from `model_loader_extra_config`).
CONFIG: dict[str, type | tuple[type, ...]] = {name: o.config for name, o in TABLE.items() if o.config is not None}


def check(name: str, value: Any) -> Any:
    """The value of option `name`, checked (TypeError, ValueError naming it) and normalised (sizes in bytes)."""
    return TABLE[name].check(value, name)


def checked(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of `iter`, from `given` (all of them, by name), checked and normalised."""
    return {name: option.check(given[name], name) for name, option in TABLE.items()}


class Options(TypedDict, total=False):
    """The keyword options of `iter`, which `load`, `layers`, `load_into`, `from_pretrained` and
    `offload` pass on (the names of `TABLE`)."""

    device: str | torch.device | None
    dtype: DTypeOption
    reader: ReaderName
    ring_bytes: int | str | None
    chunk_bytes: int | str | None
    threads: int | None
    slots: int | None
    include: Patterns
    exclude: Patterns
    into: Mapping[str, torch.Tensor] | None
    shard: ShardSpec | None
    verify: Verify
    order: Order
    cooperative: bool | ProcessGroup | Fleet
    cache_dir: PathLike | None
    peers: str | Sequence[str] | None


@dataclass(frozen=True)
class ReadOptions:
    """How a stream reads: the reader, and the tuning as given (None: from the machine, base/tuning.py)."""

    reader: ReaderName = "auto"
    ring_bytes: int | None = None
    chunk_bytes: int | None = None
    threads: int | None = None
    slots: int | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> ReadOptions:
        """Those of `options` (checked: sizes in bytes)."""
        return cls(**{name: options[name] for name in READ if name in options})

    def tuning(self, device_type: str, total_bytes: int, copies: bool) -> tuning.Tuning:
        """The tuning of a load of `total_bytes` into `device_type`: what was given, the rest from the
        machine; `copies`: most bytes are copied into tensors that exist already (`into=`)."""
        from streamload.device import kind_of  # torch: imported when a load starts, not with the options

        return tuning.tuning(
            kind_of(device_type).staging, total_bytes, ring_bytes=self.ring_bytes, slots=self.slots,
            threads=self.threads, chunk_bytes=self.chunk_bytes, copies=copies,
        )  # fmt: skip


READ = tuple(f.name for f in fields(ReadOptions))

__all__ = ["CONFIG", "READ", "TABLE", "Option", "Options", "ReadOptions", "check", "checked"]
