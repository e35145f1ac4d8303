"""`streamload.from_pretrained`: a folder's model or pipeline, by what the folder holds (transformers or diffusers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload.base import progress
from streamload.base.errors import SourceError
from streamload.integrations import diffusers, transformers
from streamload.integrations.device_map import DeviceMap, one_device
from streamload.nn.load_into import OnLayer
from streamload.options import TABLE
from streamload.storage.base import redacted
from streamload.storage.hub import hub_id, snapshot_folder
from streamload.storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options


@progress.shown  # a bar on a terminal, where transformers draws its "Loading weights"
def from_pretrained(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    device_map: DeviceMap = None,
    dtype: diffusers.Dtype = None,
    model_class: type[nn.Module] | None = None,
    variant: str | None = None,
    on_layer: OnLayer | None = None,
    strict: bool = True,
    trust_remote_code: bool = False,
    **options: Unpack[Options],
) -> Any:
    """Load a model or a diffusion pipeline from its folder, the weights streamed in.

    What the folder holds decides: a diffusers pipeline (`model_index.json`) gives the
    `DiffusionPipeline` with every component's weights streamed in one load; a diffusers model
    (`config.json` naming its `_class_name`) gives the model; a transformers model (`config.json`,
    `save_pretrained`'s layout) gives the model. Each also from object storage (`s3://bucket/model/`,
    `https://host/model/`): its small files fetched, its weights streamed.

    Args:
        path: the folder, its object-storage prefix, or a Hugging Face hub id (`org/name[@revision]`).
        device: where the weights go ("cpu", "cuda", "cuda:N"; default cuda when available).
        device_map: transformers' name for it, where it names one device: a device ("cpu", "cuda:0", a
            `torch.device`, a GPU's index), "auto" (or "balanced", "sequential") on a machine with at most
            one GPU (where `device` would default), or a dict whose entries all name one device
            (`{"": "cuda:0"}`). A model spread over several devices, or offloaded to disk, is refused.
        dtype: the floating-point dtype of the weights (default: as the folder's library's own `from_pretrained`
            chooses); for a transformers model also "auto", for a pipeline also per component, as diffusers takes
            it: `{"transformer": torch.bfloat16, "default": torch.float16}`.
        model_class: (transformers) the class to build (default: the config's `architectures[0]`).
        variant: (diffusers) the weight files' variant, e.g. "fp16" (`diffusion_pytorch_model.fp16.safetensors`);
            a component without that variant loads its plain files.
        on_layer: called with (key, submodule) as each layer is complete, while later ones load.
        strict: a key the model needs and the checkpoint lacks is an error, raised before any weight is read.
        trust_remote_code: (transformers) run the Python files a local folder's config names (`auto_map`): its
            config and model classes, as transformers does with True. Default: such a config is refused.
        **options: the options of `streamload.iter` (reader, threads, ...).

    Returns:
        The model (in eval mode) or the pipeline, on `device`. On a terminal, a progress bar once the load
        has run a second (`STREAMLOAD_PROGRESS_AFTER`), unless Hugging Face's switches turned bars off.

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
    device = one_device(path, device, device_map)
    mapped = tuple(device_map) if isinstance(device_map, dict) else ()  # the module names a dict places
    if not is_url(str(path)):
        if hub_id(path) is not None:  # a hub id naming nothing local: its snapshot, downloaded where absent
            cache_dir = options.get("cache_dir")
            path = snapshot_folder(str(path), None if cache_dir is None else Path(str(cache_dir)))
        _check_folder(Path(path))
    if diffusers.kind(path) is not None:
        if model_class is not None or trust_remote_code:
            given = "model_class=" if model_class is not None else "trust_remote_code="
            raise ValueError(f"{redacted(path)}: {given} is for transformers models, not diffusers folders")
        return diffusers.from_pretrained(path, device=device, dtype=dtype, variant=variant, on_layer=on_layer,
                                         strict=strict, mapped=mapped, **options)  # fmt: skip
    if variant is not None:
        raise ValueError(
            f"{redacted(path)}: variant= is for diffusers folders; give a transformers model its files' folder"
        )
    if dtype is not None and not isinstance(dtype, (torch.dtype, str)):
        raise ValueError(f"{redacted(path)}: a dtype per component is for diffusers pipelines; give one dtype")
    return transformers.from_pretrained(path, device=device, dtype=dtype, model_class=model_class, on_layer=on_layer,  # nosec B615 # streamload's own: no hub download
                                        strict=strict, trust_remote_code=trust_remote_code,
                                        mapped=mapped, **options)  # fmt: skip


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
