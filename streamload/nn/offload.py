"""`streamload.offload`: run a model larger than the device's memory, its blocks streamed in ahead of use.

The weights outside the blocks (embeddings, final norm, head) and as many blocks as the budget allows
stay resident. Every other block (a decoder layer, found by the same layer keys as `layers()`) is
fetched through the loader, `ahead` blocks before the block that runs, and dropped once it has run:
from the checkpoint each pass, or, with `host_cache`, from a pinned host copy made on first use.
Fetches run on a thread of their own (and the loader's own CUDA stream), so the compute never waits
on the host for a block that has already arrived; they continue across passes, so `generate()` finds
the first blocks of its next step already on their way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from streamload.api import iter as stream_tensors
from streamload.base.errors import StreamloadError, UnsupportedError, listed
from streamload.base.limits import shared_limits
from streamload.device import kind_of, resolve
from streamload.format.header import TensorInfo
from streamload.nn.load_into import Filler, load_into
from streamload.plan.checkpoint import Checkpoint, Source, open_checkpoint
from streamload.plan.layer_keys import group_of, layer_of, layer_rank
from streamload.plan.placement import Conversion
from streamload.plan.plan import DTypeOption, DTypeRules, out_dtype

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options


class _KeptOpen:
    """Local storage whose files stay open (descriptors, and the mappings the mapped reader views)
    from one fetch to the next, where each layer's load would map its shard anew and unmap it after."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.storage = checkpoint.storage
        self._headers = {f.path: f for f in checkpoint.files}
        self._files: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.storage, name)  # local, first_batch, digest, sidecar: the local storage's own

    def held_until_checked(self) -> _KeptOpen:
        return self  # nothing it serves waits for a verdict

    def open(self, headers: Any, partly: Any = ()) -> Any:
        with self._lock:
            if self._files is None:
                self._files = _Shared(self.storage.open(self._headers))
            return self._files

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, None
        if files is not None:
            files.files.close()


class _Shared:
    """The open files, handed to every fetch; a fetch's close leaves them open (the handle closes them)."""

    def __init__(self, files: Any) -> None:
        self.files = files

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)  # fd, mapping, direct_fd

    def cancel(self) -> None:
        pass  # local reads end within one chunk

    def close(self) -> None:
        pass


class _Slot(NamedTuple):
    """Where one tensor of a block goes: the owning module, the attribute, and its meta stand-in."""

    owner: nn.Module
    attr: str
    parameter: bool
    placeholder: torch.Tensor


class _Fetched(NamedTuple):
    tensors: dict[str, torch.Tensor]
    ready: object | None  # the device kind's marker, recorded after the block's host-to-device copies (host_cache)


class _Block(NamedTuple):
    module: nn.Module
    names: tuple[str, ...]  # the checkpoint's
    nbytes: int
    slots: dict[str, _Slot]  # by the model's names
    conversion: Conversion  # the block's sources -> its tensors (empty: as stored)


class OffloadStats(NamedTuple):
    budget_bytes: int
    resident_bytes: int  # the weights that never move
    block_bytes: int  # the largest offloaded block
    resident_blocks: int
    offloaded_blocks: int
    fetches: int  # blocks brought in so far
    peak_bytes: int  # most weight bytes held at once, resident and streamed together
    waited_s: float  # time the compute spent waiting for a block that had not arrived


class Offloaded:
    """A model whose offloaded blocks are fetched as it runs. Use as a context manager, or `close()`
    it: that stops the fetches and drops every streamed block (the model is left with them on meta)."""

    def __init__(
        self,
        model: nn.Module,
        checkpoint: Checkpoint,
        blocks: list[_Block],
        device: torch.device,
        budget_bytes: int,
        resident_bytes: int,
        resident_blocks: int,
        ahead: int,
        host_cache: bool,
        options: dict[str, Any],
    ) -> None:
        self._kept = _KeptOpen(checkpoint) if checkpoint.storage.local else None
        if self._kept is not None:
            checkpoint = checkpoint._replace(storage=self._kept)
        self.model, self.checkpoint, self.blocks, self.device = model, checkpoint, blocks, device
        self._kind = kind_of(device)
        self.budget_bytes, self.resident_bytes, self.ahead = budget_bytes, resident_bytes, ahead
        self.resident_blocks = resident_blocks
        self.host_cache, self.options = host_cache, options
        self._index = {id(b.module): i for i, b in enumerate(blocks)}
        self._fetching: dict[int, Future[_Fetched]] = {}
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # CPU, mapped reader: blocks that are views
        self._streams: set[Any] = set()  # open TensorStreams of fetches in flight, closed on reset
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="streamload-offload")
        shared_limits().join()  # the reader threads stay up between the fetches of one block and the next
        self._lock = threading.Lock()
        self._held = self._peak = resident_bytes  # weight bytes on the device now, and at most
        self._fetches, self._waited, self._closed = 0, 0.0, False
        self._hooks = [b.module.register_forward_pre_hook(self._before) for b in blocks]
        self._hooks += [b.module.register_forward_hook(self._after) for b in blocks]
        self._forward = model.forward
        model.forward = self._guarded  # type: ignore[method-assign]

    @property
    def stats(self) -> OffloadStats:
        largest = max((b.nbytes for b in self.blocks), default=0)
        return OffloadStats(self.budget_bytes, self.resident_bytes, largest, self.resident_blocks, len(self.blocks),
                            self._fetches, self._peak, self._waited)  # fmt: skip

    # -- the hooks -----------------------------------------------------------------------------------
    def _guarded(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; an error (or a cancellation) in it stops every fetch and drops every
        streamed block, so nothing is left running or held."""
        try:
            return self._forward(*args, **kwargs)
        except BaseException:
            self.reset()
            raise

    def _before(self, module: nn.Module, args: Any) -> None:
        if self._closed:
            raise StreamloadError("the offloaded model was closed")
        i = self._index[id(module)]
        wanted = [(i + step) % len(self.blocks) for step in range(self.ahead + 1)]  # on into the next pass
        self._forget(set(wanted))
        future = self._fetch(i)
        for j in wanted[1:]:
            self._fetch(j)
        start = time.perf_counter()
        fetched = future.result()
        self._waited += time.perf_counter() - start
        self._kind.wait_ready(self.device, fetched.ready)  # the compute waits on the device, never the host
        block = self.blocks[i]
        for name, t in fetched.tensors.items():
            self._kind.hand_off(t)  # the block is freed after the forward: after the compute's use
            slot = block.slots[name]
            table = slot.owner._parameters if slot.parameter else slot.owner._buffers
            table[slot.attr] = nn.Parameter(t, requires_grad=False) if slot.parameter else t

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        self._drop(self._index[id(module)])

    # -- fetching ------------------------------------------------------------------------------------
    def _fetch(self, i: int) -> Future[_Fetched]:
        with self._lock:
            future = self._fetching.get(i)
            if future is None:
                future = self._fetching[i] = self._pool.submit(self._load, i)
            return future

    def _load(self, i: int) -> _Fetched:
        block = self.blocks[i]
        ready = None
        if self.host_cache:
            host = self._host.get(i)
            if host is None:
                host = self._host[i] = {n: self._kind.pin(t) for n, t in self._stream(block, "cpu")}
            # on the device's copy stream, so that the copies overlap the compute (one stream for every
            # fetch: blocks freed there are reused there)
            with self._kind.copy_stream(self.device):
                out = {n: t.to(self.device, non_blocking=True) for n, t in host.items()}
                ready = self._kind.mark_ready(self.device)
        elif (out := self._views.get(i)) is None:  # the loader hands a tensor out once it is complete
            out = dict(self._stream(block, self.device))
            if self._only_views(out):
                self._views[i] = out
        with self._lock:
            self._held += block.nbytes
            self._peak = max(self._peak, self._held)
            self._fetches += 1
        return _Fetched(out, ready)

    def _only_views(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether every tensor is a view of the kept file mappings (the mapped CPU reader, no dtype
        conversion): such a block holds no memory of its own, only page-cache pages the kernel can
        reclaim, so it is kept for the next passes instead of being mapped and planned anew each time
        (measured: 2.5-4.5 ms a layer on 2 cores, most of the gap to the whole model)."""
        files = self._kept.open(()) if self._kept is not None and self._kind.host_memory else None
        if files is None:
            return False
        for name, t in tensors.items():
            info = self.checkpoint.tensors.get(name)
            if info is None:  # a tensor of the model's own (converted): no view of the file
                return False
            if info.nbytes and t.untyped_storage().data_ptr() != files.mapping(info.path).data_ptr():
                return False
        return True

    def _stream(self, block: _Block, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        """The block's tensors under the model's names; a tensor several sources fill is allocated
        for this fetch and handed on once every source is read into its region."""
        convert = block.conversion
        fused = {t: torch.empty(shape, dtype=block.slots[t].placeholder.dtype, device=device)
                 for t, shape in convert.shapes.items()}  # fmt: skip
        left = {t: len(sources) for t, sources in convert.fused().items()}
        into = convert.views(fused)
        stream = stream_tensors(self.checkpoint, device=device, include=list(block.names), **self.options,
                                **({"into": into} if into else {}))  # fmt: skip
        with self._lock:
            self._streams.add(stream)
        try:
            with stream:
                for name, t in stream:
                    target = convert.target_of(name)
                    if target not in fused:
                        yield target, t
                        continue
                    left[target] -= 1  # its bytes are in its region already
                    if left[target] == 0:
                        yield target, fused[target]
        finally:
            with self._lock:
                self._streams.discard(stream)

    def _forget(self, wanted: set[int]) -> None:
        """Drop fetches the forward did not ask for after all (it skipped or reordered blocks)."""
        with self._lock:
            unwanted = [(j, f) for j, f in self._fetching.items() if j not in wanted]
        for j, future in unwanted:
            if future.cancel() or future.done():
                self._drop(j)

    def _drop(self, i: int) -> None:
        """Put the block's weights back on meta and forget its fetch (its memory goes with it)."""
        block = self.blocks[i]
        for slot in block.slots.values():
            table = slot.owner._parameters if slot.parameter else slot.owner._buffers
            table[slot.attr] = slot.placeholder
        with self._lock:
            future = self._fetching.pop(i, None)
            if future is not None and future.done() and not future.cancelled() and future.exception() is None:
                self._held -= block.nbytes

    def reset(self) -> None:
        """Stop the fetches in flight and drop every streamed block (after an error, or to free memory)."""
        with self._lock:
            pending = list(self._fetching.items())
            streams = list(self._streams)
        for _, future in pending:
            future.cancel()
        for stream in streams:
            stream.close()  # a fetch in flight stops within its current read
        for i, future in pending:
            with contextlib.suppress(BaseException):  # a stopped fetch: nothing to keep
                future.result()
            self._drop(i)

    def close(self) -> None:
        """Stop fetching, drop streamed blocks and host copies, and remove the hooks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._pool.shutdown(wait=True)
        shared_limits().leave()
        if self._kept is not None:
            self._kept.close()
        for h in self._hooks:
            h.remove()
        self.model.forward = self._forward  # type: ignore[method-assign]
        self._host.clear()
        self._views.clear()

    def __enter__(self) -> Offloaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def offload(
    model: nn.Module,
    source: Source | Checkpoint,
    *,
    budget_bytes: int,
    device: str | torch.device | None = None,
    ahead: int = 1,
    host_cache: bool = False,
    conversion: Conversion | None = None,
    **options: Unpack[Options],
) -> Offloaded:
    """Run `model` (built with `empty_weights`) with at most `budget_bytes` of weights on `device`.

    Args:
        model: a module whose parameters are on the meta device (`streamload.empty_weights()`).
        source: the checkpoint, as for `iter` (or a `Checkpoint` from `inspect`).
        budget_bytes: weight bytes the device may hold: the weights outside the blocks, the blocks
            kept resident, and the `ahead + 1` blocks being streamed.
        device: "cpu", "cuda" or "cuda:N" (default: cuda when available).
        ahead: how many blocks are fetched before the one that runs.
        host_cache: (GPU) keep each streamed block in pinned host memory after its first fetch, and
            fetch it from there (a host-to-device copy) instead of from storage.
        conversion: checkpoint names -> the regions of the model's tensors they fill, as for
            `load_into` (a mixture of experts stored expert by expert, fused in the model): a
            block's fused tensors are allocated for each fetch and every source read into its place.
        **options: the options of `iter` (dtype, reader, threads, ...).

    Returns:
        An `Offloaded` handle; the model runs as usual (`forward`, `generate`) while it is open.

    Raises:
        StreamloadError: the budget cannot hold the resident weights and `ahead + 1` of the largest
            block (raised before any weight is read, with the numbers), or the checkpoint does not
            fit the model.

    Example:
        >>> with streamload.empty_weights():  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> with streamload.offload(model, "llama/", device="cuda", budget_bytes=8 << 30):  # doctest: +SKIP
        ...     model.generate(ids, max_new_tokens=32)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload runs a torch.nn.Module, not {type(model).__name__}: build the model first")
    dev = resolve(device)
    if ahead < 0:
        raise ValueError(f"ahead must be 0 or more, not {ahead}")
    if host_cache and kind_of(dev).host_memory:
        raise UnsupportedError("host_cache keeps blocks in pinned host memory for a GPU: use it with device='cuda'")
    for banned in ("include", "exclude", "shard", "cooperative"):
        if banned in options:
            raise UnsupportedError(f"offload chooses what to read itself: {banned}= is not an option here")
    checkpoint = open_checkpoint(source, options.get("cache_dir"))  # type: ignore[arg-type]
    convert = conversion or Conversion()
    layout = _layout(checkpoint, convert, DTypeRules.ready(options.get("dtype")), budget_bytes, ahead)
    _check_fits(model, checkpoint, convert)  # before any read
    if layout.keep:
        load_into(model, checkpoint, device=dev, include=layout.keep, strict=False,
                  conversion=convert.only(layout.keep), **options)  # type: ignore[misc]  # fmt: skip
    for name, b in list(model.named_buffers()):  # those the constructor made (not in the checkpoint) go along
        if not b.is_meta and b.device != dev:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = b.to(dev)
    by_key, block_bytes = layout.by_key, layout.block_bytes
    blocks = [_block(model, key, by_key[key], block_bytes[key], convert.only(by_key[key])) for key in layout.streamed]
    resident_bytes = layout.fixed_bytes + sum(block_bytes[k] for k in layout.resident)
    return Offloaded(model, checkpoint, blocks, dev, budget_bytes, resident_bytes, len(layout.resident), ahead,
                     host_cache, dict(options))  # fmt: skip


class _Layout(NamedTuple):
    """Which weights stay on the device and which blocks stream, within the budget."""

    by_key: dict[str, list[str]]  # the checkpoint's names by the module they land in
    block_bytes: dict[str, int]  # by block, in the order the forward runs them
    fixed_bytes: int  # the weights outside the blocks
    resident: list[str]  # the blocks kept on the device (the first ones)
    streamed: list[str]  # the blocks fetched as the forward reaches them
    keep: list[str]  # the names loaded once, up front


def _layout(checkpoint: Checkpoint, convert: Conversion, dtype: DTypeRules, budget_bytes: int, ahead: int) -> _Layout:
    """The weights outside the blocks and `ahead + 1` of the largest block must fit the budget (else a
    one-line error with the numbers); as many of the first blocks as the rest allows stay resident."""
    sizes = {n: _out_bytes(t, dtype) for n, t in checkpoint.tensors.items()}
    by_key: dict[str, list[str]] = {}
    for name in checkpoint.tensors:  # by the module the tensor lands in (a rename may move it)
        by_key.setdefault(group_of(convert.target_of(name)), []).append(name)
    # in the order the forward runs them (the files may hold layer 10 before layer 2)
    layer_keys = sorted((k for k in by_key if layer_of(k + ".") is not None), key=lambda k: layer_rank(k + "."))
    fixed = [n for k, names in by_key.items() if k not in layer_keys for n in names]
    fixed_bytes = sum(sizes[n] for n in fixed)
    block_bytes = {k: sum(sizes[n] for n in by_key[k]) for k in layer_keys}
    largest = max(block_bytes.values(), default=0)
    streaming = (ahead + 1) * largest
    if fixed_bytes + streaming > budget_bytes:
        raise StreamloadError(
            f"offload: a budget of {budget_bytes} bytes cannot hold the weights outside the blocks "
            f"({fixed_bytes} bytes) and {ahead + 1} blocks of the largest size ({largest} bytes each, "
            f"ahead={ahead}): it needs at least {fixed_bytes + streaming} bytes"
        )
    resident: list[str] = []
    left = budget_bytes - fixed_bytes - streaming
    for key in layer_keys:  # the first blocks stay: the rest stream
        if block_bytes[key] > left:
            break
        resident.append(key)
        left -= block_bytes[key]
    keep = fixed + [n for k in resident for n in by_key[k]]
    return _Layout(by_key, block_bytes, fixed_bytes, resident, layer_keys[len(resident) :], keep)


def _check_fits(model: nn.Module, checkpoint: Checkpoint, convert: Conversion) -> None:
    """What the model needs and the checkpoint lacks (tied weights count as present), as one line."""
    if convert.regions:
        convert.check({n: t.shape for n, t in checkpoint.tensors.items() if n in convert.regions})
    names = convert.targets(checkpoint.tensors)
    Filler(model).check_names(names, fix="check that the checkpoint is this model's")
    # buffers no checkpoint holds (rotary inv_freq) must come from the constructor, not stay on meta
    empty = [n for n, b in model.named_buffers() if b.is_meta and n not in names]
    if empty:
        raise StreamloadError(
            f"offload: buffers {listed(empty, 5)} are on the meta device and not in the checkpoint, so nothing would "
            "fill them (the model was built under torch.device('meta')?): build it under "
            "streamload.empty_weights(), which makes buffers for real and leaves only parameters on meta"
        )


def _out_bytes(info: TensorInfo, dtype: DTypeOption | DTypeRules) -> int:
    """Bytes a tensor takes as handed out: `dtype=` applies as the plan applies it (patterns too)."""
    stored = info.dtype.torch_dtype
    out = stored if stored is None else out_dtype(info, stored, dtype)
    return info.nbytes if out == stored else info.numel * out.itemsize  # type: ignore[union-attr]


def _block(model: nn.Module, key: str, names: list[str], nbytes: int, conversion: Conversion) -> _Block:
    slots = {}
    for name in sorted(conversion.targets(names)):
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        parameter = attr in owner._parameters
        current = owner._parameters[attr] if parameter else owner._buffers[attr]
        if current is None or not current.is_meta:
            raise StreamloadError(f"offload: {name} should be on the meta device (build the model in empty_weights())")
        slots[name] = _Slot(owner, attr, parameter, current)
    return _Block(model.get_submodule(key), tuple(names), nbytes, slots, conversion)


__all__ = ["OffloadStats", "Offloaded", "offload"]
