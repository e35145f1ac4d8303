"""streamload as a vLLM load format: `LLM(model, load_format="streamload")`, `vllm serve M --load-format streamload`.

`pip install "streamload[vllm]"` registers the format through vLLM's `vllm.general_plugins` entry
point, in every vLLM process; user code imports nothing. Options come as `model_loader_extra_config`
(`OPTIONS`). The loader:

1. resolves the checkpoint as vLLM's default loader does (a local directory, a hub id downloaded into
   vLLM's download dir, the object-storage `model_weights` vLLM pulled configs for), or `source`;
2. learns, by a dry run of the model's own `load_weights` on stand-ins (`dryrun.py`), which part of
   each tensor this tensor-parallel rank keeps and which parameter view it lands in;
3. streams only those bytes, in layer order, straight into the parameters (`iter(shard=, into=)`);
   tensors the dry run could not predict are read whole and go through `load_weights` as usual.

`get_all_weights` streams whole tensors in layer order, which is what vLLM's in-place
`reload_weights(weights_path=...)` asks a loader for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from . import api
from .dryrun import Learned, dry_run
from .dtypes import torch_shape
from .errors import StreamloadError
from .plan import converts
from .shard import SKIP, ShardSpec, Slice
from .source import Checkpoint, open_checkpoint

log = logging.getLogger("vllm.streamload")  # under vLLM's logger: shown with vLLM's own lines


@dataclass
class Report:
    """What the last load in this process did (`last_load`): for logs, tests and benchmarks."""

    seconds: float = 0.0
    plan_seconds: float = 0.0  # of which: headers and the dry run, before the first byte is read
    bytes_read: int = 0
    bytes_total: int = 0  # the whole checkpoint
    direct: int = 0  # tensors written straight into their parameters
    through_model: int = 0  # tensors read whole and given to the model's load_weights
    unused: int = 0  # tensors the model does not use: never read
    bytes_fair: int = 0  # 1/world of each tensor the ranks split plus every other tensor read: the goal
    why_whole: dict[str, str] = field(default_factory=dict)  # a few unpredicted tensors, and why


last_load = Report()

FORMAT = "streamload"
# model_loader_extra_config keys: streamload.iter's tuning, where the weights are, and two switches.
OPTIONS: dict[str, type | tuple[type, ...]] = {
    "reader": str,
    "threads": int,
    "ring_bytes": int,
    "slots": int,
    "chunk_bytes": int,
    "cache_dir": str,
    "source": str,  # weights from here (a directory, s3://, http(s)://) while configs come from `model`
    "direct": bool,  # dry run + rank-local reads straight into the parameters (default True)
    "cooperative": bool,  # tensor-parallel ranks divide what several of them read whole (default False)
}
_STREAM = ("reader", "threads", "ring_bytes", "slots", "chunk_bytes", "cache_dir")


def register() -> None:
    """The `vllm.general_plugins` entry point: registers the "streamload" load format (idempotent)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(FORMAT) is not StreamloadModelLoader:
        register_model_loader(FORMAT)(StreamloadModelLoader)


def check_options(extra: Any) -> dict[str, Any]:
    """`model_loader_extra_config`, checked: known keys with values of the right type."""
    if not isinstance(extra, dict):
        raise ValueError(
            f"model_loader_extra_config for load format {FORMAT!r} must be a dict, not {type(extra).__name__}"
        )
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown model_loader_extra_config keys for load format {FORMAT!r}: {', '.join(unknown)}; "
            f"known keys: {', '.join(OPTIONS)}"
        )
    for key, value in extra.items():
        want = OPTIONS[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            kind = want.__name__ if isinstance(want, type) else " or ".join(t.__name__ for t in want)
            raise ValueError(f"model_loader_extra_config[{key!r}] must be a {kind}, not {value!r}")
    return dict(extra)


class StreamloadModelLoader(BaseModelLoader):
    """vLLM's `BaseModelLoader` on streamload's pipeline (see the module's docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = check_options(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        self.source(model_config, first=True)

    def source(self, model_config: ModelConfig, first: bool = False) -> str:
        """Where the weights are, resolved the way vLLM's default loader resolves a model. The `source`
        option applies to the `first` load only, not to a reload from a new path."""
        model = model_config.model
        if first and self.options.get("source"):
            return str(self.options["source"])
        if getattr(model_config, "model_weights", ""):  # object storage: vLLM pulled the configs
            return str(model_config.model_weights)
        if os.path.exists(model) or "://" in model:
            return model
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(
            model,
            self.load_config.download_dir,
            ["*.safetensors", "*.safetensors.index.json"],
            model_config.revision,
            ignore_patterns=self.load_config.ignore_patterns,
        )

    def _stream_options(self, model: nn.Module) -> dict[str, Any]:
        options: dict[str, Any] = {k: self.options[k] for k in _STREAM if k in self.options}
        return {"device": _device_of(model), **options}

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) in layer order: what vLLM's `reload_weights` feeds `load_weights`."""
        yield from self._whole(self.source(model_config), model)

    def _whole(self, source: str | Checkpoint, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        with api.iter(source, **self._stream_options(model)) as stream:
            yield from stream
        _report(stream, None, 1)

    def load_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        # A speculative drafter shares this load config; the `source` option is the main model's.
        self._main = model_config is vllm_config.model_config
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        start = time.perf_counter()
        # The headers, read once for the dry run and the stream (a Checkpoint is its own source).
        source = open_checkpoint(
            self.source(model_config, first=getattr(self, "_main", True)), self.options.get("cache_dir")
        )
        options = self._stream_options(model)
        learned, loaded = (
            self._learn(model, source, options["device"]) if self.options.get("direct", True) else (None, None)
        )
        last_load.plan_seconds = time.perf_counter() - start
        rank, world = _tp_rank_world()
        if self.options.get("cooperative") and world > 1:
            if not _every_rank(learned is not None):  # the ranks exchange only if they all read alike
                learned, loaded = None, None
            options["cooperative"] = _tp_group(options["device"])
        if learned is None:
            with api.iter(source, **options) as stream:
                feed = (pair for pair in stream)
                result = model.load_weights(feed)
                for _ in feed:  # what the model left unread: read, so that cooperative ranks stay in step
                    pass
            loaded = _union(set(), result)
        else:
            spec = ShardSpec(_rule(learned), rank=rank, world_size=world)
            into = {name: copy.dest for name, copy in learned.copies.items()}
            with api.iter(source, shard=spec, into=into, **options) as stream:
                feed = _unpredicted(stream, learned)
                result = model.load_weights(feed)
                for _ in feed:  # the model stopped early: its dry run still placed the rest
                    pass
            loaded = _union(loaded, result)
        _report(stream, learned, world)
        last_load.seconds = time.perf_counter() - start
        log.info(
            "streamload: %d tensors straight into their parameters, %d through load_weights%s, %d unused; "
            "%.1f of %.1f MB read",
            last_load.direct,
            last_load.through_model,
            f" (e.g. {last_load.why_whole})" if last_load.why_whole else "",
            last_load.unused,
            last_load.bytes_read / 1e6,
            last_load.bytes_total / 1e6,
        )
        log.info("Loading weights took %.2f seconds", last_load.seconds)
        if model_config.quantization is None and loaded is not None:  # None: the model does not track
            DefaultModelLoader.track_weights_loading(self, model, loaded)  # type: ignore[arg-type]

    def _learn(
        self, model: nn.Module, checkpoint: Checkpoint, device: torch.device
    ) -> tuple[Learned | None, set[str] | None]:
        if _quantized_while_loading(model):  # its loaders record what they get for later: no stand-ins
            return None, None
        tensors = {}
        for name, info in checkpoint.tensors.items():
            shape, dtype = torch_shape(info.dtype, info.shape), info.dtype.torch_dtype
            if shape is not None and dtype is not None:
                tensors[name] = (shape, dtype)
        try:
            learned, loaded = dry_run(model.load_weights, tensors)
        except Exception as exc:  # the real run gives the model's own error, if it is one
            log.warning(
                "streamload: the dry run of %s.load_weights failed (%s); loading whole tensors",
                type(model).__name__,
                exc,
            )
            return None, None
        learned.whole.update(dict.fromkeys(set(checkpoint.tensors) - set(tensors), "no torch dtype"))
        for name, copy in list(learned.copies.items()):  # what the stream cannot write in place, the model does
            why = _cannot_write(copy.dest, tensors[name][1], device)
            if why:
                del learned.copies[name]
                learned.whole[name] = why
        return learned, None if loaded is None else set(loaded)


def _cannot_write(dest: torch.Tensor, stored: torch.dtype, device: torch.device) -> str:
    """Why `iter(into=...)` would refuse `dest` (the checks its plan and `api.iter` make), or ""."""
    if not api._same_device(dest.device, device):
        return f"its parameter is on {dest.device}"
    if not converts(stored, dest.dtype):
        return f"{stored} into a {dest.dtype} parameter"
    if dest.requires_grad:
        return "its parameter requires grad"
    return ""


def _quantized_while_loading(model: nn.Module) -> bool:
    return any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules()) or any(
        p.is_meta for p in model.parameters()
    )


def _union(loaded: set[str] | None, result: Any) -> set[str] | None:
    return None if loaded is None or result is None else loaded | set(result)


def _every_rank(ok: bool) -> bool:
    """Whether `ok` holds on every tensor-parallel rank (a collective over vLLM's TP group)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return bool(flag.item())


def _report(stream: Any, learned: Learned | None, world: int) -> None:
    stats, tensors = stream.stats, stream.checkpoint.tensors
    last_load.bytes_read, last_load.bytes_total = stats.bytes_read, stream.checkpoint.nbytes
    last_load.direct = len(learned.copies) if learned else 0
    last_load.unused = len(learned.unused) if learned else 0
    last_load.through_model = stats.tensors_total - last_load.direct
    split = {n for n, c in learned.copies.items() if c.part is not None} if learned else set()
    unused = learned.unused if learned else set()
    last_load.bytes_fair = sum(
        t.nbytes // world if n in split else t.nbytes for n, t in tensors.items() if n not in unused
    )
    last_load.why_whole = dict(list(learned.whole.items())[:3]) if learned else {}


def _rule(learned: Learned) -> Any:
    def rule(name: str, shape: tuple[int, ...]) -> Slice | str | None:
        copy = learned.copies.get(name)
        if copy is not None:
            return copy.part
        return SKIP if name in learned.unused else None

    return rule


def _unpredicted(stream: Any, learned: Learned) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's tensors that the dry run could not place; the others are in place already."""
    for name, t in stream:
        if name not in learned.copies:
            yield name, t


def _device_of(model: nn.Module) -> torch.device:
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:  # an in-place reload puts layers on meta until their weights are in
        from vllm.platforms import current_platform

        device = torch.device(current_platform.device_type)
    return api._device(device)


def _tp_rank_world() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no model-parallel groups: a model built outside an engine
        return 0, 1


def _tp_group(device: torch.device) -> Any:
    """vLLM's group of the tensor-parallel ranks (every rank is in load_weights when it is used)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.device_group if device.type == "cuda" else group.cpu_group


__all__ = [
    "FORMAT",
    "OPTIONS",
    "Report",
    "StreamloadError",
    "StreamloadModelLoader",
    "check_options",
    "last_load",
    "register",
]
