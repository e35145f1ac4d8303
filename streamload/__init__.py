"""streamload: stream safetensors checkpoints into memory, each tensor as soon as its bytes arrive.

>>> import streamload
>>> state = streamload.load("model.safetensors", device="cpu")  # doctest: +SKIP
"""

from typing import TYPE_CHECKING, Any

from .api import inspect, iter, load
from .errors import (
    HeaderError,
    IntegrityError,
    MissingFileError,
    ReadError,
    SourceError,
    StreamloadError,
    UnsupportedError,
)
from .format import FileHeader, TensorInfo
from .layer_keys import Layer, group_of, layer_of
from .layers import LayerStream, layers  # the module `streamload.layers` is shadowed by its function
from .limits import Usage, set_limits, usage
from .source import Checkpoint
from .stats import Stats
from .stream import TensorStream

if TYPE_CHECKING:
    from .hf import from_pretrained
    from .module import LoadResult, aload_into, empty_weights, load_into
    from .shard import ShardSpec

# Imported on first use: a plain load needs none of them (`import streamload` is on a load's clock).
_LAZY = {"LoadResult": "module", "aload_into": "module", "empty_weights": "module", "load_into": "module",
         "ShardSpec": "shard", "from_pretrained": "hf", "offload": "offloaded", "Offloaded": "offloaded"}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"
__all__ = [
    "Checkpoint",
    "FileHeader",
    "HeaderError",
    "IntegrityError",
    "Layer",
    "LayerStream",
    "LoadResult",
    "MissingFileError",
    "Offloaded",
    "ReadError",
    "ShardSpec",
    "SourceError",
    "Stats",
    "StreamloadError",
    "TensorInfo",
    "TensorStream",
    "UnsupportedError",
    "Usage",
    "aload_into",
    "empty_weights",
    "from_pretrained",
    "group_of",
    "inspect",
    "iter",
    "layer_of",
    "layers",
    "load",
    "load_into",
    "offload",
    "set_limits",
    "usage",
]
