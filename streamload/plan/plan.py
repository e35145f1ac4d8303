"""The plan: which tensors, in which order, packed into batches that each fit one staging slot."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from streamload.base.errors import UnsupportedError
from streamload.base.gc_pause import collector_paused
from streamload.format.dtypes import DTYPES, as_torch_dtype, torch_shape
from streamload.format.header import FileHeader, TensorInfo
from streamload.plan.checkpoint import Checkpoint
from streamload.plan.layer_keys import layer_rank

if TYPE_CHECKING:
    from streamload.plan.shard import ShardSpec, Slice

Patterns = str | Sequence[str] | Callable[[str], bool] | None
DTypeOption = torch.dtype | str | Mapping[str, torch.dtype | str | None] | None  # a name: "float16"
Order = Literal["layer", "file"]
Share = Callable[[Sequence["Item"]], Collection[str]]  # which of these whole-tensor reads all ranks share
MIN_STRIDED_READ = 1 << 20  # strided slices with smaller blocks are read as whole tensors
SLOT_ALIGN = 64  # each piece starts 64-byte aligned in its slot, so any dtype view of it is legal


class Item(NamedTuple):
    """A tensor as it will be delivered: where its bytes are and what torch tensor they become."""

    info: TensorInfo
    shape: tuple[int, ...]  # torch shape delivered (F4 packs two elements per torch element)
    stored: torch.dtype  # dtype of the bytes
    out: torch.dtype  # dtype handed to the caller
    ranges: tuple[tuple[int, int], ...]  # (file offset, length) read; concatenated, the delivered bytes
    nbytes: int  # of the ranges together (asked for by every piece: a slice can have thousands of ranges)
    part: Slice | None = None  # this rank's slice of the full tensor, if sharded
    read_whole: bool = False  # the ranges are the whole tensor: take `part` of it after reading
    into: torch.Tensor | None = None  # an existing tensor the bytes are written into (in place), delivered as is
    full_shape: bool = False  # delivered in the full tensor's shape, only `part` written (ShardSpec.full_shape)
    read_in_place: bool = False  # the reader writes the bytes straight into `into`: no slot holds them, nothing copies

    @property
    def name(self) -> str:
        return self.info.name


class Piece(NamedTuple):
    """`length` bytes of `item`, from `file_offset`, that are bytes `offset...` of the delivered
    tensor, placed at `slot_offset` of a slot."""

    item: Item
    offset: int
    length: int
    slot_offset: int
    file_offset: int

    @property
    def last(self) -> bool:
        return self.offset + self.length == self.item.nbytes


class Batch(NamedTuple):
    """The pieces read into one slot together. A shared batch holds bytes every rank of a cooperative
    load needs: each rank reads a part of it and the ranks exchange the rest (cooperative/shares.py)."""

    index: int
    pieces: tuple[Piece, ...]
    shared: bool = False

    @property
    def nbytes(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def extent(self) -> int:
        """Bytes of the slot the batch spans (pieces and the alignment gaps between them)."""
        return max((p.slot_offset + p.length for p in self.pieces), default=0)

    def window(self, lo: int, hi: int) -> Batch:
        """The part of this batch that lands in slot bytes [lo, hi)."""
        pieces = []
        for p in self.pieces:
            start, end = max(lo, p.slot_offset), min(hi, p.slot_offset + p.length)
            if start < end:
                d = start - p.slot_offset
                pieces.append(Piece(p.item, p.offset + d, end - start, start, p.file_offset + d))
        return Batch(self.index, tuple(pieces), self.shared)


class Plan(NamedTuple):
    items: tuple[Item, ...]
    batches: tuple[Batch, ...]
    files: dict[Path, FileHeader]  # the files the selected tensors come from

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @collector_paused
    def without_destinations(self) -> Plan:
        """This plan as a closed stream keeps it: no tensor of `into=` held, no batch (nothing is left to read)."""
        if all(item.into is None for item in self.items):
            return self
        items = tuple(item if item.into is None else item._replace(into=None) for item in self.items)
        return self._replace(items=items, batches=())

    def items_by_file(self) -> dict[Path, list[Item]]:
        by_file: dict[Path, list[Item]] = {}
        for item in self.items:
            by_file.setdefault(item.info.path, []).append(item)  # type: ignore[arg-type]
        return by_file

    def read_in_part(self) -> dict[Path, str]:
        """The files this plan does not read every byte of (their data), each with a reason."""
        out: dict[Path, str] = {}
        by_file = self.items_by_file()
        for path, header in self.files.items():
            items = by_file.get(path, [])
            cut = next((i.name for i in items if i.ranges != ((i.info.begin, i.info.nbytes),)), None)
            if len(items) < len(header.tensors):
                out[path] = f"{len(header.tensors) - len(items)} of its tensors are left out"
            elif cut is not None:
                out[path] = f"tensor {cut!r} is read in part"
        return out


def _matcher(patterns: Patterns) -> Callable[[str], bool] | None:
    if patterns is None:
        return None
    if callable(patterns):
        return patterns
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    exact = {p for p in pats if not any(c in p for c in "*?[")}  # plain names: a set lookup, not fnmatch
    wild = [p for p in pats if p not in exact]
    return lambda name: name in exact or any(fnmatch.fnmatchcase(name, p) for p in wild)


def select(names: Iterable[str], include: Patterns = None, exclude: Patterns = None) -> list[str]:
    """Names kept by `include` (all when None) and not dropped by `exclude` (fnmatch patterns or predicates)."""
    inc, exc = _matcher(include), _matcher(exclude)
    return [n for n in names if (inc is None or inc(n)) and not (exc is not None and exc(n))]


def out_dtype(info: TensorInfo, stored: torch.dtype, dtype: DTypeOption | DTypeRules) -> torch.dtype:
    """The dtype to hand out: `dtype` applies to floating-point tensors only (not fp8, ints, bool)."""
    if dtype is None or not info.dtype.floating:
        return stored
    if not isinstance(dtype, (torch.dtype, str)):
        dtype = (dtype if isinstance(dtype, DTypeRules) else DTypeRules.of(dtype)).match(info.name)
    return stored if dtype is None else as_torch_dtype(dtype)


class DTypeRules(NamedTuple):
    """A {pattern: dtype} option made ready once for a plan's every tensor: the first rule that
    matches a name decides, as in the option's order, but a plain name is looked up, and only the
    patterns before it are matched (a load of thousands of names, each its own rule, stays linear)."""

    exact: dict[str, tuple[int, Any]]  # plain name -> (its place among the rules, dtype)
    wild: list[tuple[int, str, Any]]

    @staticmethod
    def of(dtype: Mapping[str, Any]) -> DTypeRules:
        exact: dict[str, tuple[int, Any]] = {}
        wild: list[tuple[int, str, Any]] = []
        for i, (p, d) in enumerate(dtype.items()):
            if any(c in p for c in "*?["):
                wild.append((i, p, d))
            else:
                exact.setdefault(p, (i, d))
        return DTypeRules(exact, wild)

    @staticmethod
    def ready(dtype: DTypeOption | DTypeRules) -> DTypeOption | DTypeRules:
        """`dtype` made ready once for `out_dtype` over many tensors."""
        return DTypeRules.of(dtype) if isinstance(dtype, Mapping) else dtype

    def match(self, name: str) -> Any:
        """The dtype of the first rule that matches `name` (None: none does, or it says "as stored")."""
        hit = self.exact.get(name)
        for i, pattern, d in self.wild:
            if hit is not None and i > hit[0]:
                break
            if fnmatch.fnmatchcase(name, pattern):
                return d
        return None if hit is None else hit[1]


@collector_paused
def make_plan(
    checkpoint: Checkpoint,
    *,
    slot_bytes: int,
    include: Patterns = None,
    exclude: Patterns = None,
    order: Order = "layer",
    dtype: DTypeOption = None,
    shard: ShardSpec | None = None,
    share: Share | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    first_batch: int = 0,
    read_in_place: bool = False,
) -> Plan:
    """Select, order and pack the tensors of `checkpoint` into batches of at most `slot_bytes`;
    with `shard`, only this rank's part of each tensor (and only its bytes are read).

    `first_batch` (bytes, 0: none): the first batches are smaller, from this size doubling up to a
    slot, so that the first tensors are handed out after their own bytes, not a slot's (a store
    behind a network: a 64 MiB slot is seconds at 200 Mbit/s).

    `share` (cooperative loading) is asked which whole-tensor reads every rank makes; those are
    packed into shared batches of their own, laid out alike on every rank whatever else a rank reads.
    `into` names existing tensors to write in place (their dtype is the one delivered); with `read_in_place`
    (a reader that can, a load whose bytes no one else looks at in the slot) the reader writes straight
    into those that can take the stored bytes as they are (`Item.read_in_place`).
    """
    if order not in ("layer", "file"):
        raise ValueError(f"order must be 'layer' or 'file', not {order!r}")
    _check_dtype_option(dtype)
    if slot_bytes < SLOT_ALIGN or slot_bytes % SLOT_ALIGN:
        raise ValueError(f"slot size must be a positive multiple of {SLOT_ALIGN} bytes, not {slot_bytes}")
    infos = ordered(checkpoint, select(checkpoint.tensors, include, exclude), order)
    spec = shard.resolved() if shard is not None else None  # (plan/shard.py is imported only by those who shard)
    rules = DTypeRules.ready(dtype)
    items = tuple(item for t in infos if (item := _item(t, rules, spec)) is not None)
    if into:
        items = tuple(_into(item, into[item.name], read_in_place) if item.name in into else item for item in items)
    used = {t.path for t in infos}
    files = {f.path: f for f in checkpoint.files if f.path in used}
    if share is None:
        return Plan(items, tuple(_pack(items, slot_bytes, first_batch)), files)
    agreed = set(share([i for i in items if i.part is None or i.read_whole]))
    shared = _pack([i for i in items if i.name in agreed], slot_bytes, first_batch, shared=True)
    local = _pack([i for i in items if i.name not in agreed], slot_bytes, first_batch)
    # Delivered in the order of their first tensors: layer by layer, whichever kind a batch is.
    position = {item.name: k for k, item in enumerate(items)}
    merged = sorted(shared + local, key=lambda b: position[b.pieces[0].item.name])
    return Plan(items, tuple(Batch(k, b.pieces, b.shared) for k, b in enumerate(merged)), files)


def ordered(checkpoint: Checkpoint, names: Iterable[str], order: Order = "layer") -> list[TensorInfo]:
    """The tensors `names` of `checkpoint` in the order a plan delivers them (of one kind of batch)."""
    # By the path objects' identity (a tensor holds its header's path): hashing a path per tensor costs
    # microseconds; equal paths that are other objects fall back to the path itself.
    file_rank = {id(f.path): i for i, f in enumerate(checkpoint.files)}
    by_path = {f.path: i for i, f in enumerate(checkpoint.files)}

    def by_file(t: TensorInfo) -> tuple[int, int]:
        rank = file_rank.get(id(t.path))
        return (by_path[t.path] if rank is None else rank, t.begin)

    infos = [checkpoint.tensors[n] for n in names]
    infos.sort(key=(lambda t: (layer_rank(t.name), by_file(t))) if order == "layer" else by_file)
    return infos


def _check_dtype_option(dtype: DTypeOption) -> None:
    """`dtype=` converts floating-point tensors; to an integer or bool dtype that would truncate them."""
    if dtype is not None and not isinstance(dtype, (torch.dtype, str, Mapping)):
        raise UnsupportedError(f"dtype={dtype!r}: pass a torch dtype, its name ('float16'), or {{name pattern: dtype}}")
    targets = [dtype] if isinstance(dtype, (torch.dtype, str)) else list((dtype or {}).values())
    for target in (as_torch_dtype(t) for t in targets if t is not None):
        if not (target.is_floating_point or target.is_complex):
            raise UnsupportedError(
                f"dtype={target} would truncate floating-point weights: `dtype=` converts floating-point "
                "tensors to another floating-point dtype (float16, bfloat16, float32, ...); to get integers, "
                "convert the loaded tensors yourself"
            )


def _item(info: TensorInfo, dtype: DTypeOption | DTypeRules, shard: ShardSpec | None) -> Item | None:
    stored = info.dtype.torch_dtype
    shape = torch_shape(info.dtype, info.shape)
    if stored is None or shape is None:
        raise UnsupportedError(
            f"{info.path}: tensor {info.name!r}: dtype {info.dtype.name} with shape {list(info.shape)} "
            f"has no torch representation in torch {torch.__version__}"
        )
    out = out_dtype(info, stored, dtype)
    whole = ((info.begin, info.nbytes),)
    if shard is None:
        return Item(info, shape, stored, out, whole, info.nbytes)
    from streamload.plan.shard import SKIP, Slice, byte_ranges

    part = shard.slice(info.name, shape)
    if part == SKIP:
        return None
    if not isinstance(part, Slice) or part.length == shape[part.dim]:  # whole: a world of one
        return Item(info, shape, stored, out, whole, info.nbytes)
    ranges = byte_ranges(info.begin, shape, stored.itemsize, part)
    sliced = part.shape(shape)
    # Decided on the widest rank's block, so every rank decides alike (cooperative loads rely on it).
    assert shard.world_size is not None
    widest = -(-shape[part.dim] // shard.world_size)
    block = widest * math.prod(shape[part.dim + 1 :]) * stored.itemsize
    if len(ranges) > 1 and block < MIN_STRIDED_READ:
        # Many small strided pieces: whole rows (the whole tensor) read in one go are cheaper than
        # scattered small reads (measured: ~4x faster cold for a rank's columns of o_proj/down_proj).
        return Item(info, sliced, stored, out, whole, info.nbytes, part, True, full_shape=shard.full_shape)
    kept = tuple(r for r in ranges if r[1])
    return Item(info, sliced, stored, out, kept, sum(n for _, n in kept), part, full_shape=shard.full_shape)


# The dtypes `dtype=` converts (format/dtypes.py's `floating`): float64, float32, float16, bfloat16.
_PLAIN_FLOATS = frozenset(d.torch_dtype for d in DTYPES.values() if d.floating)


def scaled(dtype: torch.dtype) -> bool:
    """Whether `dtype` holds values that mean something only with a scale (float8, float4)."""
    return dtype.is_floating_point and dtype not in _PLAIN_FLOATS


def cannot_convert(stored: torch.dtype, dest: torch.dtype) -> str:
    """Why bytes of `stored` are not written into a `dest` tensor of another dtype, in words."""
    held = next((d for d in (stored, dest) if scaled(d)), None)
    if held is not None:
        return (
            f"{held} holds scaled values: cast without its scale it would be wrong data (only float64, "
            "float32, float16 and bfloat16 are converted)"
        )
    return "only floating-point tensors are converted"


def why_not_into(stored: torch.dtype, dest: torch.Tensor, device: torch.device | None = None) -> str:
    """Why `iter(into=...)` refuses to write bytes stored as `stored` into `dest`, whatever the shapes
    (`_into` checks those), or "". With `device` (resolved: `device.resolve`): also a `dest` elsewhere."""
    if device is not None and (
        dest.device.type != device.type
        or (None not in (device.index, dest.device.index) and dest.device.index != device.index)
    ):  # an index left out: the current one
        return f"cannot load in place into a tensor on {dest.device} from a stream into {device}"
    # Same dtype, or one plain float to another: a float8 or float4 value means something only with its
    # scale (a block's, a channel's); cast alone, into or out of them, it is wrong data.
    if dest.dtype != stored and not (stored in _PLAIN_FLOATS and dest.dtype in _PLAIN_FLOATS):
        return f"cannot load {stored} in place into a {dest.dtype} tensor: {cannot_convert(stored, dest.dtype)}"
    if dest.is_meta:
        return "cannot load in place into a tensor on the meta device"
    return ""


def _into(item: Item, dest: torch.Tensor, in_place: bool = False) -> Item:
    """`item` written into `dest`: same shape (this rank's part), a dtype the stored one converts to;
    read straight into it (`in_place`) where it is contiguous host memory of the stored dtype."""
    where = f"{item.info.path}: tensor {item.name!r}"
    if item.full_shape:
        raise UnsupportedError(f"{where}: into= and ShardSpec(full_shape=True) do not go together")
    if tuple(dest.shape) != item.shape:
        raise UnsupportedError(
            f"{where}: cannot load in place into a tensor of shape {list(dest.shape)}: the checkpoint's "
            f"{'part for this rank' if item.part is not None else 'tensor'} has shape {list(item.shape)}"
        )
    if why := why_not_into(item.stored, dest):
        raise UnsupportedError(f"{where}: {why}")
    direct = in_place and dest.is_cpu and dest.dtype == item.stored and dest.is_contiguous()  # host memory
    return item._replace(out=dest.dtype, into=dest, read_in_place=direct and not item.read_whole)


def _pack(items: Sequence[Item], slot_bytes: int, first_batch: int = 0, shared: bool = False) -> list[Batch]:
    """Greedy packing in order. A tensor that fits a slot is never split; a larger one is cut into
    slot-sized pieces on element boundaries (so each piece converts on its own). A sharded tensor's
    byte ranges are laid out back to back, in the order they make up the rank's slice. With
    `first_batch`, batch k closes at `first_batch * 2**k` bytes (up to a slot), or after its first tensor."""
    batches: list[Batch] = []
    pieces: list[Piece] = []
    used = 0

    def close() -> None:
        nonlocal pieces, used
        if pieces:
            batches.append(Batch(len(batches), tuple(pieces), shared))
        pieces, used = [], 0

    def limit() -> int:
        return min(slot_bytes, first_batch << min(len(batches), 40)) if first_batch else slot_bytes

    for item in items:
        size = item.nbytes
        if _aligned(used) + size > limit():
            close()
        width = max(1, item.stored.itemsize)
        at = _aligned(used)  # an item starts aligned; its ranges follow each other without gaps
        offset = 0
        for file_offset, length in item.ranges or ((item.info.begin, 0),):
            done = 0
            while True:
                room = (slot_bytes - at) // width * width
                if room == 0 and length > done:  # the rest continues in the next slot
                    close()
                    at, room = 0, slot_bytes // width * width
                n = min(room, length - done)
                pieces.append(Piece(item, offset, n, at, file_offset + done))
                at += n
                used = at
                offset += n
                done += n
                if done >= length:
                    break
    close()
    return batches


def _aligned(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN
