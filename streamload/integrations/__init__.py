"""Frameworks on streamload's public API, one module each: `transformers` and `diffusers` (behind
`streamload.from_pretrained`), `vllm` (the "streamload" load format, its dry run and weight sync)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload.errors import SourceError
from streamload.module import OnLayer
from streamload.options import TABLE
from streamload.storage.base import redacted
from streamload.storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options

    from .diffusers import Dtype


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: Dtype = None,
    model_class: type[nn.Module] | None = None,
    variant: str | None = None,
    on_layer: OnLayer | None = None,
    strict: bool = True,
    **options: Unpack[Options],
) -> Any:
    """Load a model or a diffusion pipeline from its folder, the weights streamed in.

    What the folder holds decides: a diffusers pipeline (`model_index.json`) gives the
    `DiffusionPipeline` with every component's weights streamed in one load; a diffusers model
    (`config.json` naming its `_class_name`) gives the model; a transformers model (`config.json`,
    `save_pretrained`'s layout) gives the model. Each also from object storage (`s3://bucket/model/`,
    `https://host/model/`): its small files fetched, its weights streamed.

    Args:
        path: the folder, or its object-storage prefix.
        device: where the weights go ("cpu", "cuda", "cuda:N"; default cuda when available).
        dtype: the floating-point dtype of the weights (default: as stored); for a pipeline also per
            component, as diffusers takes it: `{"transformer": torch.bfloat16, "default": torch.float16}`.
        model_class: (transformers) the class to build (default: the config's `architectures[0]`).
        variant: (diffusers) the weight files' variant, e.g. "fp16" (`diffusion_pytorch_model.fp16.safetensors`);
            a component without that variant loads its plain files.
        on_layer: called with (key, submodule) as each layer is complete, while later ones load.
        strict: a key the model needs and the checkpoint lacks is an error, raised before any weight is read.
        **options: the options of `streamload.iter` (reader, threads, ...).

    Returns:
        The model (in eval mode) or the pipeline, on `device`.

    Example:
        >>> model = streamload.from_pretrained("path/to/llama", device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> pipe = streamload.from_pretrained("path/to/sd-turbo", device="cuda", variant="fp16")  # doctest: +SKIP
        >>> image = pipe("a lighthouse at dusk", num_inference_steps=1).images[0]  # doctest: +SKIP
    """
    if "torch_dtype" in options:  # transformers' and diffusers' earlier name for dtype=, which they accept
        if dtype is not None:
            raise ValueError(f"{redacted(path)}: give dtype= or torch_dtype= (its earlier name), not both")
        dtype = options.pop("torch_dtype")  # type: ignore[typeddict-item]
    unknown = sorted(set(options) - set(TABLE))
    if unknown:  # before a model is built, not when its weights are read
        raise TypeError(f"from_pretrained() got unexpected keyword arguments: {', '.join(unknown)}")
    if not is_url(str(path)):
        _check_folder(Path(path))
    from . import diffusers

    if diffusers.kind(path if is_url(str(path)) else Path(path)) is not None:
        if model_class is not None:
            raise ValueError(f"{redacted(path)}: model_class= is for transformers models, not diffusers folders")
        return diffusers.from_pretrained(path, device=device, dtype=dtype, variant=variant, on_layer=on_layer,
                                         strict=strict, **options)  # fmt: skip
    from . import transformers

    if variant is not None:
        raise ValueError(
            f"{redacted(path)}: variant= is for diffusers folders; give a transformers model its files' folder"
        )
    if dtype is not None and not isinstance(dtype, (torch.dtype, str)):
        raise ValueError(f"{redacted(path)}: a dtype per component is for diffusers pipelines; give one dtype")
    return transformers.from_pretrained(path, device=device, dtype=dtype, model_class=model_class, on_layer=on_layer,  # nosec B615 # streamload's own: no hub download
                                        strict=strict, **options)  # fmt: skip


def _check_folder(folder: Path) -> None:
    """A local folder from_pretrained can build a model from, or a one-line error saying what is missing."""
    if not folder.exists():
        raise SourceError(f"{folder}: no such directory")
    if not folder.is_dir():
        raise SourceError(
            f"{folder}: a file, not a model's folder: from_pretrained builds the model from the folder's config.json "
            "(or model_index.json); for the tensors alone use streamload.load"
        )
    if not (folder / "config.json").is_file() and not (folder / "model_index.json").is_file():
        raise SourceError(
            f"{folder}: no config.json (nor model_index.json): from_pretrained builds the model from its config; "
            "for the tensors alone use streamload.load, or streamload.load_into on a model you build"
        )


__all__ = ["from_pretrained"]
