"""streamload as a vLLM load format: `LLM(model, load_format="streamload")`, `vllm serve M --load-format streamload`.

`pip install -e ".[vllm]"` registers the format through vLLM's `vllm.general_plugins` entry point
(`register`, below), in every vLLM process; user code imports nothing. Options come as
`model_loader_extra_config` (`OPTIONS`). The loader resolves the checkpoint as vLLM's default loader
does (or takes `source`), learns by a dry run of the model's own `load_weights` on stand-ins which part
of each tensor this tensor-parallel rank keeps and which parameter view it lands in, and streams only
those bytes, in layer order, straight into the parameters; tensors the dry run could not predict are
read whole and go through `load_weights` as usual. The modules and their jobs: docs/architecture.md
(`loader.py` dispatches).

`register` never raises, and importing this package imports no vLLM module (the names below are
imported on first use, `__getattr__`): vLLM calls every installed plugin in every one of its
processes, without a guard, so a plugin that raised would end every vLLM start in the environment.
On the vLLM versions the integration is tested on (it uses names of vLLM's own a release may rename)
`register` registers it, any failure logged in one line; on any other version it patches nothing and
registers a load format that refuses, naming the tested versions.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from streamload.base.errors import StreamloadError

if TYPE_CHECKING:
    from streamload.integrations.vllm.loader import StreamloadModelLoader
    from streamload.integrations.vllm.options import FORMAT, OPTIONS, check_options
    from streamload.integrations.vllm.report import Report, last_load

TESTED_VLLM = ("0.32.0",)  # the releases the integration (its hook, loaders and reloads) is tested on

log = logging.getLogger("vllm.streamload")  # under vLLM's logger: shown with vLLM's own lines

# name -> the module that defines it, imported when the name is first asked for
_EXPORTS = {
    "FORMAT": ".options",
    "OPTIONS": ".options",
    "check_options": ".options",
    "Report": ".report",
    "last_load": ".report",
    "StreamloadModelLoader": ".loader",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The `vllm.general_plugins` entry point; idempotent: vLLM may call it more than once."""
    try:
        import vllm

        version = str(vllm.__version__).split("+")[0]
        if version in TESTED_VLLM:
            _register_tested()
        else:
            _register_refusal(version)
    except Exception as exc:  # vLLM starts as if streamload were not installed
        log.warning("streamload: the 'streamload' load format is not available (%s: %s)", type(exc).__name__, exc)


def _register_tested() -> None:
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    from streamload.integrations.vllm import check, config_hook
    from streamload.integrations.vllm.loader import StreamloadModelLoader
    from streamload.integrations.vllm.options import FORMAT

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(FORMAT) is not StreamloadModelLoader:
        register_model_loader(FORMAT)(StreamloadModelLoader)
    config_hook.install()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:  # weight_transfer_config={"backend": "streamload"} (sync.py)
        WeightTransferEngineFactory.register_engine(FORMAT, f"{__name__}.sync", "StreamloadWeightTransferEngine")
    except ValueError:  # registered already (the plugin runs once per process, tests call it again)
        pass
    check.install()  # only under `streamload vllm-check`


def untested(version: str) -> str:
    return (
        f"streamload's vLLM load format is tested with vLLM {', '.join(TESTED_VLLM)} only, and this is vLLM "
        f"{version}: install one of those, or load with vLLM's own load formats"
    )


def _register_refusal(version: str) -> None:
    """A load format that refuses in one line, registered through vLLM's public API only."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from streamload.base.errors import UnsupportedError
    from streamload.integrations.vllm.options import FORMAT

    class Untested(BaseModelLoader):
        def __init__(self, load_config: object) -> None:
            raise UnsupportedError(untested(version))

        def download_model(self, model_config: object) -> None:  # pragma: no cover - never made
            raise NotImplementedError

        def load_weights(self, model: object, model_config: object) -> None:  # pragma: no cover
            raise NotImplementedError

    register_model_loader(FORMAT)(Untested)
    log.info("streamload: %s", untested(version))


__all__ = ["FORMAT", "OPTIONS", "Report", "StreamloadError", "StreamloadModelLoader", "check_options", "last_load",
           "register"]  # fmt: skip
