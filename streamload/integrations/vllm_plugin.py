"""The `vllm.general_plugins` entry point: registers the "streamload" load format, and never breaks vLLM.

vLLM calls every installed plugin in every one of its processes, without a guard: a plugin that
raises ends every vLLM start in the environment, whether or not it loads with streamload. The
integration uses names of vLLM's own that a release may rename (its config hook, loaders, reload),
so this module imports none of them: on the vLLM versions the integration is tested on it registers
it (`integrations/vllm`), any failure logged in one line; on any other version it patches nothing and
registers a load format that refuses, naming the tested versions. Plain vLLM runs as without it.
"""

from __future__ import annotations

import logging

TESTED_VLLM = ("0.32.0",)  # the releases the integration (its hook, loaders and reloads) is tested on
FORMAT = "streamload"

log = logging.getLogger("vllm.streamload")


def register() -> None:
    """Register the load format where it is tested, else one that refuses; never raises."""
    try:
        import vllm

        version = str(vllm.__version__).split("+")[0]
        if version in TESTED_VLLM:
            from . import vllm as integration

            integration.register()
        else:
            _register_refusal(version)
    except Exception as exc:  # vLLM starts as if streamload were not installed
        log.warning("streamload: the %r load format is not available (%s: %s)", FORMAT, type(exc).__name__, exc)


def untested(version: str) -> str:
    return (
        f"streamload's vLLM load format is tested with vLLM {', '.join(TESTED_VLLM)} only, and this is vLLM "
        f"{version}: install one of those, or load with vLLM's own load formats"
    )


def _register_refusal(version: str) -> None:
    """A load format named "streamload" that refuses in one line (vLLM's public registration only)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from streamload.errors import UnsupportedError

    class Untested(BaseModelLoader):
        def __init__(self, load_config: object) -> None:
            raise UnsupportedError(untested(version))

        def download_model(self, model_config: object) -> None:  # pragma: no cover - never made
            raise NotImplementedError

        def load_weights(self, model: object, model_config: object) -> None:  # pragma: no cover
            raise NotImplementedError

    register_model_loader(FORMAT)(Untested)
    log.info("streamload: %s", untested(version))
