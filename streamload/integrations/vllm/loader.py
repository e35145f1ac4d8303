"""The loader class vLLM calls (`StreamloadModelLoader`): dispatch only. Which files: files.py; the
first load: direct.py (or, compiling first, startup/overlap.py), from the files the fetch staged
(startup/ahead.py); reloads: reload.py."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from streamload import device as devices
from streamload.collector import collector_paused
from streamload.stats import Stats

from . import direct, reload, restore
from .files import Files, Part, checkpoints
from .options import STREAM, check_options
from .report import last_load
from .startup import ahead, install_compiled, overlap, recorded


class StreamloadModelLoader(BaseModelLoader):
    """vLLM's `BaseModelLoader` on streamload's pipeline (see the package's docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = check_options(load_config.model_loader_extra_config)
        self._stats: list[Stats] = []  # the last load's streams' (not the streams: they hold the parameters)
        self._files = Files(load_config)

    def download_model(self, model_config: ModelConfig) -> None:
        self.source(model_config, first=True)

    def source(self, model_config: ModelConfig, first: bool = False) -> str:
        """Where the weights are, resolved the way vLLM's default loader resolves a model. The `source`
        option applies to the `first` load only, not to a reload from a new path."""
        return self._files.resolve(model_config, self.options.get("source") if first else None)

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        """(name, tensor) in layer order: what vLLM's `reload_weights` feeds `load_weights`. Where the
        model's first load ran as its dry run predicted and the new checkpoint has the same tensors
        (names, shapes, dtypes), the reload reads what that load read: each tensor the model's loaders
        took a part of is read in that part only and handed on full-shaped, the rest of it never
        written (nor, as the dry run showed, read); tensors they never looked at are not read.
        Otherwise whole tensors, as vLLM's default loader gives them.

        A reload that fails on any rank, at any point, leaves every rank serving the weights it had
        (reload.py): the error is raised once they are back."""
        return reload.guarded(self, model_config, model)

    def load_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        # A speculative drafter shares this load config; the `source` option is the main model's.
        self._main = model_config is vllm_config.model_config
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        first = getattr(self, "_main", True)
        starting = first and not getattr(self, "_loaded", False)
        started = self.options.get("prefetch") if starting else None
        self._loaded = True
        # compiled artifacts published beside the weights, installed while they load (vLLM compiles after)
        installing = self._compile_cache(model_config) if starting else None
        try:
            if starting and self.options.get("overlap"):
                # Local files' headers and vLLM's file selection now: a broken checkpoint fails before
                # minutes of compilation (remote ones are read at the end: a request now waits behind the fetch).
                local = "://" not in self.source(model_config, first=True)
                parts = self._parts(model_config, model, first=True) if local else None
                in_place = partial(overlap.load_in_place, self)
                overlap.defer(model, model_config, partial(self._staged, started, in_place, model, model_config, parts))
            else:
                self._staged(started, self._load_weights, model, model_config, first)
            if starting:  # which compiled folder is this model's: `compile-cache publish` packs it alone
                recorded.after_compiling(self.source(model_config, first=True))
        finally:
            if installing is not None:
                last_load.compile_cache = installing.result()

    def _staged(self, started: Any, load: Callable[..., None], *args: Any) -> None:
        """`load(*args)` from the files the fetch started with the engine stages (startup/ahead.py), if any."""
        ahead.load_from_staging(self, started, load, *args)

    def _compile_cache(self, model_config: ModelConfig) -> concurrent.futures.Future[str] | None:
        """Compiled artifacts published beside the weights, fetched and installed on a thread of its own."""
        return install_compiled.start(self.options, model_config)

    @collector_paused  # a many-tensor model's placement is tens of thousands of objects (placement/twins.py)
    def _load_weights(self, model: nn.Module, model_config: ModelConfig, first: bool) -> None:
        start = time.perf_counter()
        parts = self._parts(model_config, model, first=first)  # headers read once
        options, self._stats = self._stream_options(model), []
        cooperative = bool(self.options.get("cooperative"))
        result = direct.load(model, parts, options, self._stats, self.options.get("direct"), cooperative, start)
        restore.SERVED[model] = self._served(model_config, parts)
        self._track_weights(model, model_config, result)

    def _parts(self, model_config: ModelConfig, model: nn.Module, first: bool) -> list[Part]:
        """Every place the model's weights come from (files.py), their headers read."""
        sources = self._files.sources(self.source(model_config, first), model_config, model)
        self._where = str(sources[0].model_or_path)  # what a failed reload restores from (reload.py)
        cache_dir = self.options.get("cache_dir")
        return [self._files.part(source, k == 0, cache_dir) for k, source in enumerate(sources)]

    def _stream_options(self, model: nn.Module) -> dict[str, Any]:
        options: dict[str, Any] = {k: self.options[k] for k in STREAM if k in self.options}
        return {"device": _device_of(model), **options}

    def _served(self, model_config: ModelConfig, parts: list[Part]) -> restore.Served:
        """What this load read (every file's identity and checked digests), for a failed reload to
        restore from (restore.py)."""
        return restore.Served.of(self._where, model_config, checkpoints(parts), self.options.get("verify", False))

    def _track_weights(self, model: nn.Module, model_config: ModelConfig, result: Any) -> None:
        """vLLM's check that every weight was loaded (None: the model does not track)."""
        if model_config.quantization is None and result is not None:
            DefaultModelLoader.track_weights_loading(self, model, set(result))  # type: ignore[arg-type]


def _device_of(model: nn.Module) -> torch.device:
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:  # an in-place reload puts layers on meta until their weights are in
        from vllm.platforms import current_platform

        device = torch.device(current_platform.device_type)
    return devices.resolve(device)
