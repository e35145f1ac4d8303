"""`streamload.from_pretrained`: a Hugging Face `transformers` checkpoint directory -> a ready model.

config.json -> the model built with `empty_weights` (parameters on meta, buffers real) -> weights
streamed in by `load_into` (tied weights stay tied) -> the remaining buffers moved to the device ->
`eval()`. transformers is an optional dependency: `pip install "streamload[transformers]"`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .api import _device
from .dtypes import as_torch_dtype
from .errors import UnsupportedError
from .module import OnLayer, empty_weights, load_into
from .storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .api import Options


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    model_class: type[nn.Module] | None = None,
    on_layer: OnLayer | None = None,
    strict: bool = True,
    **options: Unpack[Options],
) -> nn.Module:
    """Load a `transformers` model from a local checkpoint directory, its weights streamed in.

    Args:
        path: a directory with `config.json` and safetensors weights (`save_pretrained`'s layout), or
            the same in object storage (`s3://bucket/model/`, `https://host/model/`): config.json is
            fetched from there, the weights streamed.
        device: where the model goes ("cpu", "cuda", "cuda:N"; default cuda when available).
        dtype: the floating-point dtype of the weights (default: as stored).
        model_class: the class to build (default: the config's `architectures[0]`, else `AutoModel`).
        on_layer: called with (key, submodule) as each layer is complete, while later ones load.
        strict: a key the model needs and the checkpoint lacks is an error, raised before any weight is read.
        **options: the options of `streamload.iter` (reader, threads, ...).

    Returns:
        The model, in eval mode, on `device`.

    Raises:
        UnsupportedError: transformers is not installed, or the config names an unknown architecture.
        StreamloadError: the checkpoint does not fit the model, or it could not be read.

    Example:
        >>> model = streamload.from_pretrained("path/to/llama", device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> model(input_ids).logits  # doctest: +SKIP
    """
    try:
        import transformers
    except ImportError as exc:
        raise UnsupportedError("from_pretrained needs transformers: pip install 'streamload[transformers]'") from exc
    source: str | Path = str(path) if is_url(str(path)) else Path(path)
    dev = _device(device)
    dtype = None if dtype is None else as_torch_dtype(dtype)
    config = _config(transformers, source)
    kwargs = {} if dtype is None else {"dtype": dtype}
    with empty_weights():
        if model_class is not None:
            model = (
                model_class._from_config(config, **kwargs)
                if hasattr(model_class, "_from_config")
                else model_class(config)
            )
        else:
            model = _build(transformers, config, kwargs)
    load_into(model, source, device=dev, dtype=dtype, strict=strict, on_layer=on_layer, **options)
    model.to(dev)  # the buffers the constructor made on the CPU; parameters are there already
    return model.eval()


def _config(transformers: Any, source: str | Path) -> Any:
    """The model's config: from the folder, or fetched from the object store's prefix."""
    if isinstance(source, Path):
        return transformers.AutoConfig.from_pretrained(source)
    import tempfile

    from .storage import storage_for
    from .storage.remote import ObjectPath

    near = ObjectPath(source if source.endswith((".safetensors", ".json")) else source.rstrip("/") + "/config.json")
    raw = storage_for(source).sidecar(near, "config.json")
    if raw is None:
        raise UnsupportedError(f"{near.parent}/config.json: no such object; from_pretrained needs the model's config")
    with tempfile.TemporaryDirectory(prefix="streamload-config-") as folder:
        Path(folder, "config.json").write_bytes(raw)
        return transformers.AutoConfig.from_pretrained(folder)


def _build(transformers: Any, config: Any, kwargs: dict[str, Any]) -> nn.Module:
    names = getattr(config, "architectures", None) or []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls._from_config(config, **kwargs)
    if names:
        raise UnsupportedError(f"this transformers ({transformers.__version__}) has no model class {names[0]!r}")
    return transformers.AutoModel.from_config(config, **kwargs)
