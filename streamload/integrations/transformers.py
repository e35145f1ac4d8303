"""transformers: a checkpoint directory (or object-storage prefix) -> a ready model (`streamload.from_pretrained`).

config.json -> the model built with `empty_weights` (parameters on meta, buffers real) -> weights
streamed in by `load_into` (tied weights stay tied) -> the remaining buffers moved to the device ->
`eval()`. transformers is an optional dependency: `pip install -e ".[transformers]"`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload import device as devices
from streamload.dtypes import as_torch_dtype
from streamload.errors import UnsupportedError
from streamload.module import OnLayer, empty_weights, load_into
from streamload.storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.api import Options


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
        dtype: the floating-point dtype of the weights (default: as transformers' own `from_pretrained`
            chooses, which from transformers 5 on is the config's `dtype`; before, as stored).
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
        raise UnsupportedError("from_pretrained needs transformers: pip install -e '.[transformers]'") from exc
    source: str | Path = str(path) if is_url(str(path)) else Path(path)
    dev = devices.resolve(device)
    config = _config(transformers, source)
    dtype = default_dtype(transformers, config) if dtype is None else as_torch_dtype(dtype)
    kwargs = {} if dtype is None else {"dtype": dtype}
    # transformers' switch first: its module, imported on first use, copies torch's initialisers
    with skipped_init(transformers), empty_weights():
        if model_class is not None:
            model = (
                model_class._from_config(config, **kwargs)
                if hasattr(model_class, "_from_config")
                else model_class(config)
            )
        else:
            model = _build(transformers, config, kwargs)
    tied(model)
    load_into(model, source, device=dev, dtype=dtype, strict=strict, on_layer=on_layer, **options)
    model.to(dev)  # the buffers the constructor made on the CPU; parameters are there already
    return model.eval()


def skipped_init(transformers: Any) -> contextlib.AbstractContextManager[Any]:
    """transformers' own switch that skips `init_weights` (its initialisers keep references to torch's
    that `empty_weights` cannot patch; on meta tensors they cost ~1.5 ms a tensor for nothing). It
    skips the weight tying too: `tied` the model after."""
    try:
        no_init = importlib.import_module(f"{transformers.__name__}.initialization").no_init_weights
    except (ImportError, AttributeError):  # before transformers 5: `empty_weights` covers its initialisers
        return contextlib.nullcontext()
    return no_init()


def tied(model: nn.Module) -> nn.Module:
    """`model` with its tied weights tied, which `init_weights` does and `skipped_init` skips."""
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    return model


def default_dtype(transformers: Any, config: Any) -> torch.dtype | None:
    """The dtype transformers' `from_pretrained` gives a model when none is asked for: from version 5
    on ("auto") the config's `dtype`; None (as stored) where that is unset or before version 5."""
    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    dtype = getattr(config, "dtype", None)
    return None if dtype is None else as_torch_dtype(dtype)


def _config(transformers: Any, source: str | Path) -> Any:
    """The model's config: from the folder, or fetched from the object store's prefix."""
    if isinstance(source, Path):
        return _read_config(transformers, source, source / "config.json")
    import tempfile

    from streamload.storage import storage_for
    from streamload.storage.remote import ObjectPath

    near = ObjectPath(source if source.endswith((".safetensors", ".json")) else source.rstrip("/") + "/config.json")
    raw = storage_for(source).sidecar(near, "config.json")
    if raw is None:
        raise UnsupportedError(f"{near.parent}/config.json: no such object; from_pretrained needs the model's config")
    with tempfile.TemporaryDirectory(prefix="streamload-config-") as folder:
        Path(folder, "config.json").write_bytes(raw)
        return _read_config(transformers, Path(folder), f"{near.parent}/config.json")


def _read_config(transformers: Any, folder: Path, shown: object) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, OSError) as exc:  # not JSON, no model_type, a model_type this transformers lacks
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedError(f"{shown}: transformers cannot read this config: {reason}") from None


def _build(transformers: Any, config: Any, kwargs: dict[str, Any]) -> nn.Module:
    names = getattr(config, "architectures", None) or []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls._from_config(config, **kwargs)
    if names:
        raise UnsupportedError(f"this transformers ({transformers.__version__}) has no model class {names[0]!r}")
    return transformers.AutoModel.from_config(config, **kwargs)
