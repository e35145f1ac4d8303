"""The public face: `iter`, `load`, `inspect`. One async core; the sync face drives it from a thread."""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .device import Delivered, Device, MappedCPU, StagedCPU
from .device.cuda import CudaDevice
from .errors import StreamloadError, UnsupportedError
from .exchange import Exchange
from .limits import check_fits
from .pipeline import Receiver, Tuning, next_tensor, open_pipeline, ready_tensor
from .plan import DTypeOption, Order, Patterns, Plan, make_plan
from .read import MmapReader, PosixReader, Reader
from .shard import ShardSpec
from .source import Checkpoint, Source, open_checkpoint
from .stats import Stats

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

try:  # the sync face's event loop: import its backend now rather than inside the first load's clock
    import anyio._backends._asyncio
except ImportError:  # pragma: no cover - a future anyio may move it; then it loads on first use
    pass

ReaderName = Literal["auto", "mmap", "posix", "kvikio"]
log = logging.getLogger("streamload")
_TAKE = 256  # tensors the sync face fetches per hop to the pipeline's thread


class TensorStream:
    """`(name, tensor)` pairs of a checkpoint, each as soon as its bytes have arrived.

    Use it with `async for` or plain `for`, ideally inside `async with` / `with`, which stops the
    pipeline, joins its threads and closes its files deterministically on leaving the block. A bare
    loop cleans up when it ends, fails, or when the stream object is dropped after a `break`.
    Every tensor handed out is owned by the caller: the loader never writes to it again.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        plan: Plan,
        reader: Reader,
        device: Device,
        tuning: Tuning,
        exchange: Exchange | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.stats = Stats(
            bytes_total=plan.nbytes, tensors_total=len(plan.items), reader=reader.name, device=device.name
        )
        self.plan = plan
        self._reader, self._device, self._tuning, self._exchange = reader, device, tuning, exchange
        self._mode: Literal["async", "sync", "done"] | None = None
        self._receive: Receiver | None = None
        self._core: AbstractAsyncContextManager[Receiver] | None = None
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._sync_core: AbstractContextManager[Receiver] | None = None
        self._ready: list[Delivered] = []
        self._error: BaseException | None = None

    @property
    def metadata(self) -> dict[str, str]:
        """The checkpoint's `__metadata__` (all files merged)."""
        return self.checkpoint.metadata

    def _pipeline(self) -> AbstractAsyncContextManager[Receiver]:
        return open_pipeline(self.plan, self._reader, self._device, self._tuning, self.stats, self._exchange)

    def _claim(self, mode: Literal["async", "sync"]) -> None:
        self._check_not_done()
        if self._mode is not None:
            raise StreamloadError("this TensorStream is already running")
        self._mode = mode

    def _check_not_done(self) -> None:
        if self._mode == "done":
            raise StreamloadError("a TensorStream runs once; call streamload.iter() again for another pass")

    # -- async face: the pipeline runs in the caller's event loop, inside `async with` -----------------
    async def __aenter__(self) -> TensorStream:
        self._claim("async")
        self._core = self._pipeline()
        self._receive = await self._core.__aenter__()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        core, self._core, self._mode = self._core, None, "done"
        return await core.__aexit__(et, e, tb) if core is not None else None

    def __aiter__(self) -> TensorStream:
        self._check_not_done()
        return self

    async def __anext__(self) -> Delivered:
        if self._core is not None:
            assert self._receive is not None
            item = await next_tensor(self._receive, self.stats)
        else:  # a bare `async for`: no block to scope a task group, so the sync face runs it on a thread
            # (through a weak reference: an idle worker thread must not keep a dropped stream alive)
            item = await anyio.to_thread.run_sync(_next_of, weakref.ref(self))
        if item is None:
            raise StopAsyncIteration
        return _handoff(item)

    async def aclose(self) -> None:
        if self._core is not None:
            await self.__aexit__(None, None, None)
        else:
            await anyio.to_thread.run_sync(self.close)

    # -- sync face: the same async core on a portal thread ---------------------------------------------
    def __enter__(self) -> TensorStream:
        self._claim("sync")
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._sync_core = self._portal.wrap_async_context_manager(self._pipeline())
            self._receive = self._sync_core.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = self._portal = None
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        core, portal_cm = self._sync_core, self._portal_cm
        self._sync_core = self._portal_cm = self._portal = None
        self._mode = "done"
        try:
            if core is not None:
                core.__exit__(et, e, tb)
        finally:
            if portal_cm is not None:
                portal_cm.__exit__(None, None, None)

    def close(self) -> None:
        """Stop the pipeline and release everything (idempotent)."""
        self.__exit__(None, None, None)

    def __iter__(self) -> TensorStream:
        self._check_not_done()
        return self

    def __next__(self) -> Delivered:
        item = self._next_or_none()
        if item is None:
            raise StopIteration
        return _handoff(item)

    def _next_or_none(self) -> Delivered | None:
        if self._mode is None:
            self.__enter__()
        if not self._ready:
            if self._error is None and self._portal is not None:
                try:
                    self._ready = self._portal.call(self._take)
                except BaseException as exc:
                    self._error = exc
            if not self._ready:
                error, self._error = self._error, None
                self.close()
                if error is not None:
                    raise error
                return None
        return self._ready.pop()

    async def _take(self) -> list[Delivered]:
        assert self._receive is not None
        first = await next_tensor(self._receive, self.stats)
        if first is None:
            return []
        taken = [first]
        try:
            while len(taken) < _TAKE and (item := ready_tensor(self._receive, self.stats)) is not None:
                taken.append(item)
        except BaseException as exc:  # hand out what arrived first, then the error
            self._error = exc
        taken.reverse()  # popped from the end
        return taken

    def __del__(self) -> None:
        if self._portal_cm is not None:
            warnings.warn(
                "a streamload stream was left open and is closed by garbage collection; "
                "use `with streamload.iter(...)` or call close()",
                ResourceWarning,
                stacklevel=2,
            )
            try:
                self.close()
            except Exception:
                pass


def _next_of(ref: weakref.ref[TensorStream]) -> Delivered | None:
    stream = ref()
    return None if stream is None else stream._next_or_none()


def _handoff(item: Delivered) -> Delivered:
    """Tie a device tensor to the receiving thread's current stream (see device/cuda.py)."""
    t = item[1]
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return item


def iter(
    source: Source,
    *,
    device: str | torch.device | None = None,
    dtype: DTypeOption = None,
    include: Patterns = None,
    exclude: Patterns = None,
    order: Order = "layer",
    reader: ReaderName = "auto",
    ring_bytes: int = Tuning.ring_bytes,
    slots: int = Tuning.slots,
    threads: int = Tuning.threads,
    chunk_bytes: int = Tuning.chunk_bytes,
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
    tuning = Tuning(ring_bytes=ring_bytes, slots=slots, threads=threads, chunk_bytes=chunk_bytes)
    tuning.check()
    check_fits(tuning.slot_bytes, "a ring slot")
    dev = torch.device(device) if device is not None else _default_device()
    checkpoint = open_checkpoint(source)
    first = checkpoint.files[0].path if checkpoint.files else None
    exchange = _exchange(cooperative, dev)
    read, make = _route(dev, reader, tuning, first, exchange)
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
    return TensorStream(checkpoint, plan, read, make, tuning, exchange)


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


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _exchange(cooperative: bool | ProcessGroup, dev: torch.device) -> Exchange | None:
    if cooperative is False or cooperative is None:
        return None
    exchange = Exchange(None if cooperative is True else cooperative, dev)
    return exchange if exchange.world > 1 else None  # alone, there is nothing to divide


def _route(
    dev: torch.device, reader: str, tuning: Tuning, first_file: Path | None, exchange: Exchange | None = None
) -> tuple[Reader, Device]:
    if reader not in ("auto", "mmap", "posix", "kvikio"):
        raise ValueError(f"reader must be 'auto', 'mmap', 'posix' or 'kvikio', not {reader!r}")
    if exchange is not None and not exchange.on_device:
        # The exchange moves bytes between staging slots in host memory.
        if reader in ("mmap", "kvikio"):
            raise UnsupportedError(
                f"cooperative loading over a {'gloo' if dev.type == 'cpu' else 'host-memory'} process group "
                f"reads into host staging slots: use reader='posix' or 'auto', not {reader!r}"
            )
        reader = "posix"
    if dev.type == "cpu":
        if reader == "kvikio":
            raise UnsupportedError("the kvikio reader reads into GPU memory: use it with device='cuda'")
        # Measured (docs/benchmarks.md): mapping beats copying on the CPU, warm and cold.
        if reader == "posix":
            return PosixReader(tuning.chunk_bytes), StagedCPU()
        return MmapReader(tuning.chunk_bytes), MappedCPU()
    if dev.type != "cuda":
        raise UnsupportedError(f"device {dev} is not supported (use 'cpu', 'cuda' or 'cuda:N')")
    if not torch.cuda.is_available():
        raise UnsupportedError(f"device {dev}: this torch sees no CUDA device")
    if reader == "mmap":
        raise UnsupportedError("the mmap reader is for device='cpu'; use 'posix' or 'kvikio' with CUDA")
    if reader in ("auto", "kvikio"):
        try:
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
    return PosixReader(tuning.chunk_bytes), CudaDevice(dev, host_slots=True)


__all__ = ["TensorStream", "inspect", "iter", "load"]
