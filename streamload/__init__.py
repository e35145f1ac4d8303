"""streamload: stream safetensors checkpoints into memory, each tensor as soon as its bytes arrive.

>>> import streamload
>>> state = streamload.load("model.safetensors", device="cpu")  # doctest: +SKIP
"""

from .api import inspect, iter, load
from .errors import HeaderError, MissingFileError, ReadError, SourceError, StreamloadError, UnsupportedError
from .format import FileHeader, TensorInfo
from .grouped import LayerStream, layers
from .layers import Layer, group_of, layer_of
from .limits import Usage, set_limits, usage
from .module import LoadResult, aload_into, load_into
from .shard import ShardSpec
from .source import Checkpoint
from .stats import Stats
from .stream import TensorStream

__version__ = "0.1.0"
__all__ = [
    "Checkpoint",
    "FileHeader",
    "HeaderError",
    "Layer",
    "LayerStream",
    "LoadResult",
    "MissingFileError",
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
    "group_of",
    "inspect",
    "iter",
    "layer_of",
    "layers",
    "load",
    "load_into",
    "set_limits",
    "usage",
]
