"""The public face: `iter`, `load`, `inspect`. The stream's two faces are in pipeline/stream.py."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, NamedTuple

import torch

from streamload import device, options
from streamload.base import progress
from streamload.base.errors import IntegrityError, UnsupportedError, listed
from streamload.base.limits import check_fits
from streamload.base.stats import Stats
from streamload.base.tuning import Tuning
from streamload.options import Options, ReadOptions
from streamload.pipeline.pipeline import Pipeline
from streamload.pipeline.reader_choice import Into, ReaderName, route
from streamload.pipeline.stream import TensorStream
from streamload.plan.checkpoint import Checkpoint, PathLike, Source, open_checkpoint
from streamload.plan.plan import DTypeOption, Order, Patterns, Plan, Share, make_plan

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

    from streamload.cooperative.fleet import Fleet
    from streamload.cooperative.shares import Exchange
    from streamload.device import Device
    from streamload.pipeline.pipeline import Check
    from streamload.pipeline.verify import Known, Verify
    from streamload.plan.shard import ShardSpec
    from streamload.read import Reader

log = logging.getLogger("streamload")


def iter(
    source: Source,
    *,
    device: str | torch.device | None = None,
    dtype: DTypeOption = None,
    include: Patterns = None,
    exclude: Patterns = None,
    order: Order = "layer",
    reader: ReaderName = "auto",
    ring_bytes: int | str | None = None,
    slots: int | None = None,
    threads: int | None = None,
    chunk_bytes: int | str | None = None,
    shard: ShardSpec | None = None,
    cooperative: bool | ProcessGroup | Fleet = False,
    cache_dir: PathLike | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    verify: Verify = False,
    peers: str | Sequence[str] | None = None,
) -> TensorStream:
    """Stream the tensors of a safetensors checkpoint, each as soon as its bytes are in.

    Args:
        source: a file, a directory (its `model.safetensors.index.json` when present, else every
            `*.safetensors`), an index, or a list of files; or the same in object storage:
            `s3://bucket/prefix/`, `https://host/path/model.safetensors` (`streamload[remote]`).
        device: "cpu", "cuda" or "cuda:N" (default: cuda when available).
        dtype: converts floating-point tensors: a dtype, or {fnmatch pattern: dtype}.
        include, exclude: select tensors by pattern(s) or predicate; unselected bytes are never read.
        order: "layer" (layer i before layer i+1 across all files) or "file".
        reader: "auto", or one of `pipeline.reader_choice.READERS` ("mmap", "posix", "direct", "kvikio", "range").
        ring_bytes, slots, threads, chunk_bytes: the tuning (default: from the machine, base/tuning.py);
            sizes in bytes or with a unit ("1GiB", "8MiB").
        shard: a `ShardSpec`: keep only this rank's part of each tensor, reading only its bytes.
        cooperative: True (the default group; where none is initialised, the fleet that torch's
            launch variables MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK describe), a `torch.distributed`
            process group, or a `streamload.Fleet(address, world_size, rank)`, for ranks on shared
            storage: what several ranks read whole, each reads a share of and gets the rest by
            all-gather, so storage sees each byte once. Every rank must call `iter` alike and consume
            the stream to its end.
        cache_dir: keep a local copy of a remote checkpoint as it streams past; a later load whose
            objects are unchanged (size, ETag) reads the copy.
        into: {name: existing tensor} to write in place instead of allocating: same shape (this
            rank's part with `shard`), on `device`; floating-point tensors are converted to the
            destination's dtype. The stream hands out those very tensors.
        verify: check the bytes against known digests as they are read (no second pass): True, every
            file's known digests (a Hugging Face cache's blob names, an S3 ETag, the digest file
            `streamload digest` writes), refusing a file with none; or {file name: SHA-256 hex}, those.
            A mismatch is an `IntegrityError` naming the file (and tensor). With per-tensor digests
            each tensor is checked before it is handed out; a file known only by a whole-file digest
            is read whole, in file order, and checked at its end: `iter` may have handed out tensors
            of it already (`load` and the others return nothing unverified), except a file downloading
            from the Hugging Face hub, whose tensors wait for its SHA-256.
        peers: nodes that hold the remote checkpoint's files (`streamload seed`): peer URLs, or a host
            name whose addresses are the peers; each range they hold is read from one of them, checked
            against the source's digests first, the source serving the rest (docs/peers.md).

    Returns:
        A `TensorStream` of (name, tensor), for `for` / `async for`, best inside `with` / `async with`.

    Raises:
        SourceError, MissingFileError, HeaderError: the source is not a readable checkpoint (raised
            here, before any tensor data is read).
        UnsupportedError: the device, reader or option cannot serve this source here.
        ReadError, StreamloadError: while iterating, reading or making a tensor failed.

    Example:
        >>> import streamload
        >>> for name, t in streamload.iter("model.safetensors", device="cpu"):  # doctest: +SKIP
        ...     print(name, t.shape)
    """
    given: Options = {"device": device, "dtype": dtype, "reader": reader, "ring_bytes": ring_bytes,
                      "chunk_bytes": chunk_bytes, "threads": threads, "slots": slots, "include": include,
                      "exclude": exclude, "into": into, "shard": shard, "verify": verify, "order": order,
                      "cooperative": cooperative, "cache_dir": cache_dir, "peers": peers}  # fmt: skip
    return _opened(source, given)


def _opened(source: Source, given: Options) -> TensorStream:
    """`iter`'s stream: the options `given` (every one) checked, the checkpoint opened, the load routed and
    planned. Where it fails, the other ranks of a cooperative load are told at once (`_left`)."""
    cooperative, into = given["cooperative"], given["into"]
    exchange: Exchange | None = None
    joined = False  # whether this rank took its part in a cooperative load (its exchange, if any)
    try:
        read_options = ReadOptions.of(options.checked(given))  # every option, before anything is opened
        dev = device.resolve(given["device"])
        checkpoint = open_checkpoint(source, given["cache_dir"])
        if given["peers"]:  # a remote checkpoint read from its peers first (storage/peers.py)
            from streamload.storage.peers import with_peers

            checkpoint = checkpoint._replace(storage=with_peers(checkpoint.storage, given["peers"]))
        if absent := [n for n in into or () if n not in checkpoint.tensors]:
            raise ValueError(f"into= names tensors the checkpoint does not hold: {listed(absent, 5)}")
        joined = True
        exchange = _exchange(cooperative, dev)
        way = _route(checkpoint, dev, read_options, exchange, given)
        plan, digests = _plan(checkpoint, way, given)
        if way.exchange is not None:
            way.exchange.expect(sum(b.shared for b in plan.batches))
        _check_plan(plan, checkpoint, dev, given)
        stream = _stream(checkpoint, plan, way, digests)
        progress.watch(stream.stats)  # counted on the bar of a `load` (or from_pretrained) it is part of
        return stream
    except BaseException:
        _left(cooperative, joined, exchange)
        raise


def _left(cooperative: bool | ProcessGroup | Fleet, joined: bool, exchange: Exchange | None) -> None:
    """A cooperative iter() failed on this rank: the others are told at once (they read its share
    themselves) instead of waiting for it until the process group's timeout."""
    if joined:
        if exchange is not None:
            exchange.close()  # tells the others, and lets go of the group
        return
    if cooperative is False or cooperative is None:
        return
    from streamload.cooperative.group import leave_early

    try:
        group = _group(cooperative)
    except ValueError:
        return  # no group, no fleet: no one to tell
    leave_early(group)


class _Route(NamedTuple):
    """The way a load's bytes go: the reader and device that serve it, with what tuning."""

    tuning: Tuning
    read: Reader
    make: Device
    exchange: Exchange | None  # the ranks a cooperative load divides the reads among
    share: Share | None  # which whole-tensor reads all ranks share (cooperative)


def _route(
    checkpoint: Checkpoint, dev: torch.device, read_options: ReadOptions, exchange: Exchange | None, given: Options
) -> _Route:
    """Which reader and device serve the load, with what tuning, and whether ranks divide its reads."""
    into, total = given["into"], checkpoint.nbytes
    # most bytes copied into tensors that exist already: read through the ring, not mapped
    copies = bool(into) and 2 * sum(checkpoint.tensors[n].nbytes for n in into or ()) >= total
    tuning = read_options.tuning(dev.type, total, copies)
    tuning.check()
    check_fits(tuning.slot_bytes, "a ring slot")
    first = checkpoint.files[0].path if checkpoint.files else None
    lands: tuple[Into, ...] = ("host", "mapped", "device")  # where the bytes may land for this load, and why not
    why = ""
    if exchange is not None and not exchange.on_device:
        lands, why = ("host",), "cooperative loading over a host-memory process group reads into host staging slots"
    elif given["verify"]:
        lands, why = ("host", "mapped"), "verify= hashes the bytes in host memory"
    read, make = route(dev, read_options.reader, checkpoint.storage.local, tuning, first, total, lands, why, copies)
    log.info("streamload: %s via %s into %s", first, read.name, make.name)
    if exchange is None:
        return _Route(tuning, read, make, None, None)
    from streamload.cooperative.shares import cooperative as cooperative_pair  # the parameter keeps its name

    read, make = cooperative_pair(read, make, exchange)
    layout = f"{tuning.slot_bytes}/{given['order']}/{checkpoint.storage.first_batch}"  # what packs shared batches
    return _Route(tuning, read, make, exchange, functools.partial(exchange.agree, checkpoint, layout=layout))


def _plan(checkpoint: Checkpoint, way: _Route, given: Options) -> tuple[Plan, Mapping[PurePath, Known] | None]:
    """What is read, in which order and batches, and the digests it is checked against (None: unchecked)."""
    digests, verify, order = None, given["verify"], given["order"]
    if verify or checkpoint.checks:  # True, or a non-empty mapping (False, None, {}: nothing to verify)
        from streamload.pipeline.verify import choose

        chosen = choose(checkpoint, verify) if verify else {}
        pinned = chosen if isinstance(verify, Mapping) else {}  # the caller's own digests are never replaced
        digests = {**chosen, **checkpoint.checks, **pinned}  # a copy: its origin's digests
        if any(k.blocks is None for k in digests.values()):
            # A whole-file digest is hashed front to back, so such a file is read in file order. File by file,
            # one core hashes while the other serves the reads: measured cold (docs/benchmarks.md), 1.04x-1.19x
            # the unverified load on 2 cores, where hashing files side by side on both cost 1.33x-1.64x.
            order = "file"
    plan = make_plan(
        checkpoint,
        slot_bytes=way.tuning.slot_bytes,
        include=given["include"],
        exclude=given["exclude"],
        order=order,
        dtype=given["dtype"],
        shard=given["shard"],
        share=way.share,
        into=given["into"],
        first_batch=checkpoint.storage.first_batch,
        # a destination's bytes read straight into it, where no one looks at them in the slot
        read_in_place=getattr(way.read, "reads_in_place", False) and digests is None and way.exchange is None,
    )
    return plan, digests


def _check_plan(plan: Plan, checkpoint: Checkpoint, dev: torch.device, given: Options) -> None:
    """Refuses a plan that cannot be served; warns of one that is likely not what the caller meant."""
    include, exclude, shard, cache_dir = given["include"], given["exclude"], given["shard"], given["cache_dir"]
    for item in plan.items:
        if item.into is not None and not device.same(item.into.device, dev):
            raise UnsupportedError(
                f"{item.info.path}: tensor {item.name!r}: cannot load in place into a tensor on "
                f"{item.into.device} from a stream into {dev}: pass device={str(item.into.device)!r}"
            )
    # (`next` over generators, not over `iter(...)`: in this module `iter` is streamload's)
    if not plan.items and checkpoint.tensors and (include is not None or exclude is not None):
        warnings.warn(
            f"streamload: include={include!r} exclude={exclude!r} select none of the checkpoint's "
            f"{len(checkpoint.tensors)} tensors (e.g. {next(n for n in checkpoint.tensors)!r})",
            stacklevel=4,  # the caller of `iter` (through `_opened`)
        )
    if shard is not None and (unmatched := shard.unmatched(checkpoint.tensors)):
        warnings.warn(
            f"streamload: ShardSpec rules {', '.join(map(repr, unmatched))} match none of the checkpoint's "
            f"{len(checkpoint.tensors)} tensors (e.g. {next((n for n in checkpoint.tensors), '')!r}): the tensors they "
            "were meant for are loaded whole (patterns are fnmatch, case-sensitive, on whole names)",
            stacklevel=4,
        )
    if cache_dir is not None and not checkpoint.storage.local and (in_part := plan.read_in_part()):
        cut, reason = next(entry for entry in in_part.items())
        log.warning(
            "streamload: cache_dir keeps whole files only, and this load reads %d of %d files in part (%s: %s): "
            "they are not cached and a later load reads them remotely again; load once without include=, "
            "exclude= or shard= to cache them", len(in_part), len(plan.files), cut, reason,
        )  # fmt: skip


def _stream(checkpoint: Checkpoint, plan: Plan, way: _Route, digests: Mapping[PurePath, Known] | None) -> TensorStream:
    """The stream of `plan` through `way`, checked against `digests` as it is read."""
    check = None if digests is None else _verifier(plan, digests, way)
    if check is not None and hasattr(way.make, "keep_pages"):  # hashed after made: no page may leave before
        way.make.keep_pages = True
    stats = Stats(bytes_total=plan.nbytes, tensors_total=len(plan.items), reader=way.read.name, device=way.make.name)
    if way.exchange is not None:  # what a rank reads from storage for a lost rank counts as read
        way.read.on_bytes = stats.add_read  # type: ignore[attr-defined]  # (a CooperativeReader)
    storage = checkpoint.storage if digests is None else checkpoint.storage.held_until_checked()
    pipeline = Pipeline(plan, storage, way.read, way.make, way.tuning, stats, check)
    return TensorStream(checkpoint, plan, pipeline)


def _verifier(plan: Plan, digests: Mapping[PurePath, Known], way: _Route) -> Check:
    from streamload.pipeline.verify import Verifier

    if way.exchange is None:
        return Verifier(plan, digests)
    from streamload.cooperative.shares import CooperativeCheck

    # A shared batch's hashing waits on a verifier thread for its exchange: enough threads that every
    # batch in flight can wait (threads start only when needed).
    most = max((len({p.item.info.path for p in b.pieces}) for b in plan.batches), default=1)
    return CooperativeCheck(Verifier(plan, digests, max(4, (way.tuning.slots + 1) * most)), way.make)  # type: ignore[arg-type]


def load(source: Source, **options: Unpack[Options]) -> dict[str, torch.Tensor]:
    """Load a whole checkpoint into a dict, like `safetensors.torch.load_file`.

    Args:
        source: as for `iter`.
        **options: the options of `iter` (`Options`).

    Returns:
        {name: tensor}, in the stream's order.

    Raises:
        StreamloadError: as `iter` raises them.

    Example:
        >>> state = streamload.load("model.safetensors", device="cpu")  # doctest: +SKIP
    """
    try:
        with progress.loading(), iter(source, **options) as stream:  # a bar on a terminal, as transformers draws
            return dict(stream)
    except IntegrityError as exc:
        exc.handed_out = []  # to the dict only, which the caller never gets
        raise


def inspect(source: Source, cache_dir: PathLike | None = None) -> Checkpoint:
    """Headers only, no tensor data: files, tensors (dtype, shape, byte range) and metadata.

    Args:
        source: as for `iter` (local or remote).
        cache_dir: as for `iter`: a remote checkpoint the cache holds whole is the cache's copy (a
            load of the `Checkpoint` returned reads it there).

    Returns:
        A `Checkpoint`: `files` (validated headers), `tensors` by name, `metadata`, `nbytes`.

    Raises:
        SourceError, MissingFileError, HeaderError: the source is not a readable checkpoint.

    Example:
        >>> ckpt = streamload.inspect("model.safetensors")  # doctest: +SKIP
        >>> {n: t.shape for n, t in ckpt.tensors.items()}  # doctest: +SKIP
    """
    return open_checkpoint(source, cache_dir)


def _exchange(cooperative: bool | ProcessGroup | Fleet, dev: torch.device) -> Exchange | None:
    if cooperative is False or cooperative is None:
        return None
    from streamload.cooperative.shares import Exchange

    exchange = Exchange(_group(cooperative), dev)
    return exchange if exchange.world > 1 else None  # alone, there is nothing to divide


def _group(cooperative: bool | ProcessGroup | Fleet) -> ProcessGroup | Fleet | None:
    """The group a cooperative load divides its reads among (None: torch.distributed's default group)."""
    import torch.distributed as dist

    group = None if cooperative is True else cooperative
    if group is None and not (dist.is_available() and dist.is_initialized()):
        from streamload.cooperative.fleet import ENVIRONMENT, Fleet

        group = Fleet.from_env()
        if group is None:
            raise ValueError(
                "cooperative=True needs an initialised torch.distributed process group, or a fleet: "
                f"cooperative=streamload.Fleet('host:port', world_size, rank), or {', '.join(ENVIRONMENT)} set"
            )
    return group


__all__ = ["Options", "TensorStream", "inspect", "iter", "load"]
