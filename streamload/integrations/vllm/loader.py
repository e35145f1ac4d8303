"""The loader class vLLM calls (`StreamloadModelLoader`): dispatch only. Its state across loads:
state.py; which files: files.py; the first load: direct.py (or, compiling first, startup/overlap.py),
from the files the fetch staged (startup/ahead.py); reloads: reload.py."""

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

from streamload.base.gc_pause import collector_paused
from streamload.integrations.vllm import direct, reload, restore, seeding
from streamload.integrations.vllm.options import check_options
from streamload.integrations.vllm.report import last_load
from streamload.integrations.vllm.startup import ahead, install_compiled, overlap, recorded
from streamload.integrations.vllm.state import LoadState


class StreamloadModelLoader(BaseModelLoader):
    """vLLM's `BaseModelLoader` on streamload's pipeline (see the package's docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.state = LoadState(load_config, check_options(load_config.model_loader_extra_config))

    @property
    def options(self) -> dict[str, Any]:
        return self.state.options

    def download_model(self, model_config: ModelConfig) -> None:
        self.source(model_config, first=True)

    def source(self, model_config: ModelConfig, first: bool = False) -> str:
        return self.state.source(model_config, first)

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        """(name, tensor) in layer order: what vLLM's `reload_weights` feeds `load_weights`. Where the
        model's first load ran as its dry run predicted and the new checkpoint has the same tensors, each
        rank reads only what that load read. A reload that fails on any rank leaves every rank serving
        the weights it had (reload.py): the error is raised once they are back."""
        return reload.guarded(self.state, model_config, model)

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
        stop_seeding = self._seed(model, started) if starting else seeding.nothing  # seeds what it verifies
        try:
            if starting and self.options.get("overlap"):
                # Local files' headers and vLLM's file selection now: a broken checkpoint fails before
                # minutes of compilation (remote ones are read at the end: a request now waits behind the fetch).
                local = "://" not in self.source(model_config, first=True)
                parts = self.state.parts(model_config, model, first=True) if local else None
                in_place = partial(overlap.load_in_place, self.state)
                staged = partial(ahead.load_from_staging, self.state, started, in_place, model, model_config, parts)
                overlap.defer(model, model_config, partial(seeding.or_stop, stop_seeding, staged))  # after compiling
            else:
                ahead.load_from_staging(self.state, started, self._load_weights, model, model_config, first)
            if starting:  # which compiled folder is this model's: `compile-cache publish` packs it alone
                recorded.after_compiling(self.source(model_config, first=True))
        except BaseException:
            stop_seeding()
            raise
        finally:
            if installing is not None:
                last_load.compile_cache = installing.result()

    def _seed(self, model: nn.Module, started: Any) -> Callable[[], Any]:
        fetch = started if isinstance(started, dict) else None
        last_load.seeding, stop = seeding.start(self.options, model, fetch)
        return stop

    def _compile_cache(self, model_config: ModelConfig) -> concurrent.futures.Future[str] | None:
        return install_compiled.start(self.options, model_config)

    @collector_paused  # a many-tensor model's placement is tens of thousands of objects (placement/twins.py)
    def _load_weights(self, model: nn.Module, model_config: ModelConfig, first: bool) -> None:
        start = time.perf_counter()
        state = self.state
        parts = state.parts(model_config, model, first=first)  # headers read once
        options, state.stats = state.stream_options(model), []
        cooperative = bool(self.options.get("cooperative"))
        result = direct.load(model, parts, options, state.stats, self.options.get("direct"), cooperative, start)
        restore.SERVED[model] = state.served(model_config, parts)
        state.track_weights(model, model_config, result)
