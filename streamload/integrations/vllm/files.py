"""Which files a model's weights are read from: found as vLLM's default loader finds them (the model
path with the model's own file selection, then each of its `secondary_weights`), or listed by
streamload where vLLM has no say (object storage, a single file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import (
    filter_safetensors_files_by_weight_name,
    pt_weights_iterator,
)

from streamload.base.errors import UnsupportedError
from streamload.format.dtypes import torch_shape
from streamload.plan.checkpoint import Checkpoint, open_checkpoint
from streamload.plan.plan import ordered
from streamload.storage import redacted


class Part:
    """One place the model's weights come from (the model path, or one of its `secondary_weights`): its
    safetensors files, streamed, and the tensors of its .pt/.bin files (`others`); names prefixed."""

    def __init__(self, prefix: str, checkpoint: Checkpoint | None, others: list[tuple[str, torch.Tensor]]) -> None:
        self.prefix, self.checkpoint, self.others = prefix, checkpoint, others
        order = ordered(checkpoint, checkpoint.tensors) if checkpoint is not None else []
        self.names = {prefix + t.name: t for t in order}  # in the order the stream hands them out


class Files:
    """vLLM's default loader in its "auto" format, asked only where a model's weights are and which
    files of them it would read."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config
        files_config = LoadConfig(
            load_format="hf", download_dir=load_config.download_dir, ignore_patterns=load_config.ignore_patterns
        )
        self._default = DefaultModelLoader(files_config)

    def resolve(self, model_config: ModelConfig, given: str | None = None) -> str:
        """Where the weights are: `given` (the `source` option) if any, else resolved the way vLLM's
        default loader resolves a model (a hub id is downloaded into vLLM's download dir)."""
        model = model_config.model
        if given:
            return str(given)
        if model_config.model_weights:  # object storage: vLLM pulled the configs
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

    @staticmethod
    def sources(where: str, model_config: ModelConfig, model: nn.Module) -> list[Any]:
        """Every place the model's weights come from, as vLLM's `DefaultModelLoader.get_all_weights`
        finds them: `where`, then each of its `secondary_weights`."""
        primary = DefaultModelLoader.Source(
            where,
            model_config.revision,
            fall_back_to_pt=getattr(model, "fall_back_to_pt_during_load", True),
            allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
            is_unused_weight=getattr(model, "is_unused_checkpoint_weight", None),
        )
        return [primary, *getattr(model, "secondary_weights", ())]

    def part(self, source: Any, primary: bool, cache_dir: str | None) -> Part:
        """The files of one of `sources`, their headers read (a missing shard or a broken header fails here)."""
        where = redacted(source.model_or_path)  # no password of a URL in the message
        # object storage: the files are what streamload lists there, with no file selection to honour
        if "://" in where and (not primary or source.allow_patterns_overrides is not None):
            what = f"allow_patterns_overrides {source.allow_patterns_overrides}" if primary else "secondary weights"
            raise UnsupportedError(
                f"streamload: the model's {what} cannot be honoured for weights in object storage ({where}): "
                "give vLLM a local directory or hub id"
            )
        if "://" in where or (primary and os.path.isfile(where)):  # listed by streamload, or one file: no selection
            return Part("", open_checkpoint(where, cache_dir), [])
        # vLLM's own file selection (its "auto" format): the same files as its default loader reads.
        folder, files, _, _ = self._default._prepare_weights(
            where, source.subfolder, source.revision, source.fall_back_to_pt, source.allow_patterns_overrides
        )
        streamed = [f for f in files if f.endswith(".safetensors")]
        filtered = False
        if source.is_unused_weight is not None and streamed:
            kept = filter_safetensors_files_by_weight_name(streamed, source.is_unused_weight)
            filtered, streamed = len(kept) < len(streamed), kept
        others = [f for f in files if not f.endswith(".safetensors")]
        if primary and not streamed:
            raise UnsupportedError(
                f"streamload streams safetensors; {folder} has {', '.join(sorted({Path(f).suffix for f in others}))} "
                "weights only: use vLLM's load_format='auto' for them"
            )
        # The folder itself where vLLM takes the whole folder: its index is checked, a missing shard named.
        whole = source.allow_patterns_overrides is None and not filtered
        checkpoint = open_checkpoint(folder if whole else streamed, cache_dir) if streamed else None
        # .pt/.bin (small heads, as BGE-M3's): read whole, once, with vLLM's own reader and map_location.
        pairs = pt_weights_iterator(others, False, self.load_config.pt_load_map_location) if others else ()
        return Part(source.prefix, checkpoint, [(source.prefix + n, t) for n, t in pairs])


def shapes(parts: list[Part]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of every tensor `load_weights` gets, in the order it gets them."""
    out = {}
    for part in parts:
        for name, info in part.names.items():
            shape, dtype = torch_shape(info.dtype, info.shape), info.dtype.torch_dtype
            if shape is not None and dtype is not None:
                out[name] = (shape, dtype)
        out.update((name, (tuple(t.shape), t.dtype)) for name, t in part.others)
    return out


def checkpoints(parts: list[Part]) -> list[Checkpoint]:
    return [part.checkpoint for part in parts if part.checkpoint is not None]
