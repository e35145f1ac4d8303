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
    from streamload.base.errors import (
        HeaderError,
        IntegrityError,
        MissingFileError,
        ReadError,
        SourceError,
        StreamloadError,
        UnsupportedError,
    )
    from streamload.base.limits import Usage, set_limits, usage
    from streamload.base.stats import Stats
    from streamload.cooperative.fleet import Fleet
    from streamload.format.header import FileHeader, TensorInfo
    from streamload.integrations.pretrained import from_pretrained
    from streamload.nn.layers import LayerStream, layers
    from streamload.nn.load_into import LoadResult, aload_into, empty_weights, load_into
    from streamload.nn.offload import Offloaded, offload
    from streamload.pipeline.stream import TensorStream
    from streamload.plan.checkpoint import Checkpoint
    from streamload.plan.layer_keys import Layer, group_of, layer_of
    from streamload.plan.shard import ShardSpec

# name -> the module that defines it
_WHERE = {
    "inspect": "api", "iter": "api", "load": "api",
    "HeaderError": "base.errors", "IntegrityError": "base.errors", "MissingFileError": "base.errors",
    "ReadError": "base.errors", "SourceError": "base.errors", "StreamloadError": "base.errors",
    "UnsupportedError": "base.errors",
    "Fleet": "cooperative.fleet",
    "FileHeader": "format.header", "TensorInfo": "format.header",
    "from_pretrained": "integrations.pretrained",
    "Layer": "plan.layer_keys", "group_of": "plan.layer_keys", "layer_of": "plan.layer_keys",
    "LayerStream": "nn.layers", "layers": "nn.layers",
    "Usage": "base.limits", "set_limits": "base.limits", "usage": "base.limits",
    "LoadResult": "nn.load_into", "aload_into": "nn.load_into", "empty_weights": "nn.load_into",
    "load_into": "nn.load_into",
    "Offloaded": "nn.offload", "offload": "nn.offload",
    "ShardSpec": "plan.shard",
    "Checkpoint": "plan.checkpoint",
    "Stats": "base.stats",
    "TensorStream": "pipeline.stream",
}  # fmt: skip


def __getattr__(name: str) -> _typing.Any:
    import importlib.util  # (binds importlib too)

    module = _WHERE.get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'streamload' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)  # a submodule: streamload.plan.plan, ...
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


__version__ = "0.1.0"
__all__ = sorted(_WHERE)
