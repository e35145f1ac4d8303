"""streamload: stream safetensors checkpoints into memory, each tensor as soon as its bytes arrive.

>>> import streamload
>>> state = streamload.load("model.safetensors", device="cpu")  # doctest: +SKIP

Every public name is imported on first use: `import streamload` costs almost nothing until a load
starts (torch is imported then), and the command line installs its Ctrl-C handling before that.
"""

import typing as _typing

if _typing.TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports each name
    # ruff: noqa: F401
    from streamload.api import inspect, iter, load
    from streamload.errors import (
        HeaderError,
        IntegrityError,
        MissingFileError,
        ReadError,
        SourceError,
        StreamloadError,
        UnsupportedError,
    )
    from streamload.fleet import Fleet
    from streamload.format import FileHeader, TensorInfo
    from streamload.integrations import from_pretrained
    from streamload.layer_keys import Layer, group_of, layer_of
    from streamload.layer_stream import LayerStream, layers
    from streamload.limits import Usage, set_limits, usage
    from streamload.module import LoadResult, aload_into, empty_weights, load_into
    from streamload.offloaded import Offloaded, offload
    from streamload.shard import ShardSpec
    from streamload.source import Checkpoint
    from streamload.stats import Stats
    from streamload.stream import TensorStream

# name -> the module that defines it
_WHERE = {
    "inspect": "api", "iter": "api", "load": "api",
    "HeaderError": "errors", "IntegrityError": "errors", "MissingFileError": "errors", "ReadError": "errors",
    "SourceError": "errors", "StreamloadError": "errors", "UnsupportedError": "errors",
    "Fleet": "fleet",
    "FileHeader": "format", "TensorInfo": "format",
    "from_pretrained": "integrations",
    "Layer": "layer_keys", "group_of": "layer_keys", "layer_of": "layer_keys",
    "LayerStream": "layer_stream", "layers": "layer_stream",
    "Usage": "limits", "set_limits": "limits", "usage": "limits",
    "LoadResult": "module", "aload_into": "module", "empty_weights": "module", "load_into": "module",
    "Offloaded": "offloaded", "offload": "offloaded",
    "ShardSpec": "shard",
    "Checkpoint": "source",
    "Stats": "stats",
    "TensorStream": "stream",
}  # fmt: skip


def __getattr__(name: str) -> _typing.Any:
    import importlib
    import importlib.util

    module = _WHERE.get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'streamload' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)  # a submodule: streamload.plan, ...
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


__version__ = "0.1.0"
__all__ = sorted(_WHERE)
