"""A loader's state across its model's loads (`LoadState`), which the first load, a load after
compiling, a load from the files fetched ahead and reloads all work on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from streamload.base.stats import Stats
from streamload.device import resolve
from streamload.integrations.vllm import restore
from streamload.integrations.vllm.files import Files, Part, checkpoints
from streamload.integrations.vllm.options import STREAM


class LoadState:
    """One loader's checked `options`, the `files` vLLM's default loader would read, the last load's
    streams' `stats` (not the streams: they hold the parameters), `where` the weights last came from
    and the parts the last reload read (`reloaded`)."""

    def __init__(self, load_config: LoadConfig, options: dict[str, Any]) -> None:
        self.load_config = load_config
        self.options = options
        self.files = Files(load_config)
        self.stats: list[Stats] = []
        self.where = ""
        self.reloaded: list[Part] = []

    def source(self, model_config: ModelConfig, first: bool = False) -> str:
        """Where the weights are, resolved the way vLLM's default loader resolves a model. The `source`
        option applies to the `first` load only, not to a reload from a new path."""
        return self.files.resolve(model_config, self.options.get("source") if first else None)

    def parts(self, model_config: ModelConfig, model: nn.Module, first: bool) -> list[Part]:
        """Every place the model's weights come from, their headers read."""
        sources = self.files.sources(self.source(model_config, first), model_config, model)
        self.where = str(sources[0].model_or_path)
        cache_dir = self.options.get("cache_dir")
        return [self.files.part(source, k == 0, cache_dir) for k, source in enumerate(sources)]

    def stream_options(self, model: nn.Module) -> dict[str, Any]:
        """`iter`'s options for a stream into `model`: the streaming ones given, on the model's device."""
        return {"device": _device_of(model), **{k: self.options[k] for k in STREAM if k in self.options}}

    def served(self, model_config: ModelConfig, parts: list[Part]) -> restore.Served:
        """What a load read, for a failed reload to restore from (restore.py)."""
        return restore.Served.of(self.where, model_config, checkpoints(parts), self.options.get("verify", False))

    @staticmethod
    def track_weights(model: nn.Module, model_config: ModelConfig, result: Any) -> None:
        """vLLM's check that every weight was loaded (None: the model does not track)."""
        if model_config.quantization is None and result is not None:
            # vLLM's method reads nothing of its loader: no DefaultModelLoader is made for it
            DefaultModelLoader.track_weights_loading(None, model, set(result))  # type: ignore[arg-type]


def _device_of(model: nn.Module) -> torch.device:
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:  # an in-place reload puts layers on meta until their weights are in
        from vllm.platforms import current_platform

        device = torch.device(current_platform.device_type)
    return resolve(device)
