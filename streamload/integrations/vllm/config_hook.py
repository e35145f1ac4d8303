"""The patch of vLLM's `EngineArgs.create_load_config`: where vLLM builds the engine's load config, in
the process that starts the engine, the options are checked (a bad key fails at once, in one line,
not seconds later in a worker's traceback) and the weights start on their way (`startup/ahead.py`)."""

from __future__ import annotations

from typing import Any

from streamload.integrations.vllm.options import FORMAT, check_options
from streamload.integrations.vllm.startup import ahead


def install() -> None:
    """Patch `EngineArgs.create_load_config` (once per process)."""
    from vllm.engine.arg_utils import EngineArgs

    build = EngineArgs.create_load_config
    if getattr(build, "checks_streamload", False):
        return

    def create_load_config(self: Any) -> Any:
        config = build(self)
        if str(config.load_format).lower() == FORMAT:
            extra = check_options(config.model_loader_extra_config)
            fetches = not isinstance(extra.get("prefetch"), dict) and ahead.starts_engine(self)
            if fetches and (started := ahead.start_fetch(str(self.model), extra)):
                config.model_loader_extra_config = {**(config.model_loader_extra_config or {}), "prefetch": started}
        return config

    create_load_config.checks_streamload = True  # type: ignore[attr-defined]
    EngineArgs.create_load_config = create_load_config  # type: ignore[method-assign]
