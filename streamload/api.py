"""The public face: `iter`, `load`, `inspect`. The stream's two faces are in stream.py."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from . import defaults
from .device import Device, MappedCPU, StagedCPU
from .errors import UnsupportedError
from .limits import check_fits
from .pipeline import Pipeline, Tuning
from .plan import DTypeOption, Order, Patterns, make_plan
from .read import DirectReader, MmapReader, PosixReader, Reader
from .source import Checkpoint, Source, open_checkpoint
from .stats import Stats
from .stream import TensorStream

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .exchange import Exchange
    from .shard import ShardSpec

ReaderName = Literal["auto", "mmap", "posix", "direct", "kvikio"]
_HOST_READERS: dict[str, type[PosixReader]] = {"posix": PosixReader, "direct": DirectReader}  # into host slots
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
    ring_bytes: int | None = None,
    slots: int | None = None,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    shard: ShardSpec | None = None,
    cooperative: bool | ProcessGroup = False,
) -> TensorStream:
    """Stream the tensors of a safetensors checkpoint, each as soon as its bytes are in.

    `source` is a file, a directory (its `model.safetensors.index.json` when present) or a list of files.
    `dtype` converts floating-point tensors (a dtype, or {fnmatch pattern: dtype}); `include` /
    `exclude` select tensors by pattern or predicate, and unselected bytes are never read. `order`
    is "layer" (layer i before layer i+1 across all files) or "file". `shard` (a `ShardSpec`) keeps
    only this rank's part of each tensor, and reads only the bytes of that part.

    `cooperative=True` (or a `torch.distributed` process group; True: the default group) is for ranks
    on shared storage: what several ranks read whole (replicated tensors, whole-read slices), each
    reads a share of and gets the rest from the others by all-gather, so storage sees each byte once.
    Every rank of the group must call `iter` alike and consume the stream to its end.

    >>> import streamload
    >>> for name, t in streamload.iter("model.safetensors", device="cpu"):  # doctest: +SKIP
    ...     print(name, t.shape)
    """
    dev = _device(device)
    checkpoint = open_checkpoint(source)
    total = checkpoint.nbytes
    tuning = defaults.tuning(
        dev.type, total, ring_bytes=ring_bytes, slots=slots, threads=threads, chunk_bytes=chunk_bytes
    )
    tuning.check()
    check_fits(tuning.slot_bytes, "a ring slot")
    first = checkpoint.files[0].path if checkpoint.files else None
    exchange = _exchange(cooperative, dev)
    read, make = _route(dev, reader, tuning, first, exchange, total)
    log.info("streamload: %s via %s into %s", first, read.name, make.name)
    share = None
    if exchange is not None:
        layout = f"{tuning.slot_bytes}/{order}"
        share = functools.partial(exchange.agree, checkpoint, layout=layout)
    plan = make_plan(
        checkpoint,
        slot_bytes=tuning.slot_bytes,
        include=include,
        exclude=exclude,
        order=order,
        dtype=dtype,
        shard=shard,
        share=share,
    )
    stats = Stats(bytes_total=plan.nbytes, tensors_total=len(plan.items), reader=read.name, device=make.name)
    return TensorStream(checkpoint, plan, Pipeline(plan, read, make, tuning, stats, exchange))


def load(source: Source, **options: Any) -> dict[str, torch.Tensor]:
    """Load a whole checkpoint into a dict, like `safetensors.torch.load_file` (same options as `iter`).

    >>> state = streamload.load("model.safetensors", device="cpu")  # doctest: +SKIP
    """
    with iter(source, **options) as stream:
        return dict(stream)


def inspect(source: Source) -> Checkpoint:
    """Headers only, no tensor data: files, tensors (dtype, shape, byte range) and metadata.

    >>> ckpt = streamload.inspect("model.safetensors")  # doctest: +SKIP
    >>> {n: t.shape for n, t in ckpt.tensors.items()}  # doctest: +SKIP
    """
    return open_checkpoint(source)


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's own message lists every backend it was built with
        raise UnsupportedError(
            f"device {device!r} is not a device torch knows: use 'cpu', 'cuda' or 'cuda:N'"
        ) from None


def _exchange(cooperative: bool | ProcessGroup, dev: torch.device) -> Exchange | None:
    if cooperative is False or cooperative is None:
        return None
    from .exchange import Exchange

    exchange = Exchange(None if cooperative is True else cooperative, dev)
    return exchange if exchange.world > 1 else None  # alone, there is nothing to divide


def _host_reader(reader: str, tuning: Tuning, total_bytes: int) -> PosixReader:
    """`posix`, `direct`, or for `auto` the one that suits the load: O_DIRECT only for a checkpoint
    larger than the memory available, whose pages the page cache could not keep anyway (where it
    can, buffered reads measured faster: docs/benchmarks.md)."""
    if reader == "auto":
        memory = defaults.available_memory()
        reader = "direct" if memory is not None and total_bytes > memory else "posix"
    return _HOST_READERS[reader](tuning.chunk_bytes)


def _route(
    dev: torch.device,
    reader: str,
    tuning: Tuning,
    first_file: Path | None,
    exchange: Exchange | None = None,
    total_bytes: int = 0,
) -> tuple[Reader, Device]:
    if reader not in ("auto", "mmap", "posix", "direct", "kvikio"):
        raise ValueError(f"reader must be 'auto', 'mmap', 'posix', 'direct' or 'kvikio', not {reader!r}")
    if exchange is not None and not exchange.on_device:
        # The exchange moves bytes between staging slots in host memory.
        if reader in ("mmap", "kvikio"):
            raise UnsupportedError(
                f"cooperative loading over a {'gloo' if dev.type == 'cpu' else 'host-memory'} process group "
                f"reads into host staging slots: use reader='posix', 'direct' or 'auto', not {reader!r}"
            )
        reader = "posix" if reader == "auto" else reader
    if dev.type == "cpu":
        if reader == "kvikio":
            raise UnsupportedError("the kvikio reader reads into GPU memory: use it with device='cuda'")
        # Measured (docs/benchmarks.md): mapping beats copying on the CPU, warm and cold.
        if reader in _HOST_READERS:
            return _host_reader(reader, tuning, total_bytes), StagedCPU()
        return MmapReader(tuning.chunk_bytes), MappedCPU()
    if dev.type != "cuda":
        raise UnsupportedError(f"device {dev} is not supported (use 'cpu', 'cuda' or 'cuda:N')")
    if not torch.cuda.is_available():
        raise UnsupportedError(f"device {dev}: this torch sees no CUDA device")
    if reader == "mmap":
        raise UnsupportedError("the mmap reader is for device='cpu'; use 'posix' or 'kvikio' with CUDA")
    if reader in ("auto", "kvikio"):
        try:
            from .device.cuda import CudaDevice
            from .read.kvikio import KvikioReader

            kv = KvikioReader(tuning.threads, tuning.chunk_bytes)
            # auto takes kvikio where it can use GPUDirect Storage; in its POSIX mode it bounces
            # through host memory just as our own pinned path does.
            if reader == "kvikio" or kv.gds:
                if first_file is not None:
                    kv.probe(first_file, dev)
                return kv, CudaDevice(dev, host_slots=False)
            kv.close()
        except UnsupportedError as exc:
            if reader == "kvikio":
                raise
            log.warning("streamload: kvikio is unavailable (%s); reading with preadv into pinned memory", exc)
    from .device.cuda import CudaDevice

    return _host_reader(reader, tuning, total_bytes), CudaDevice(dev, host_slots=True)


__all__ = ["TensorStream", "inspect", "iter", "load"]
