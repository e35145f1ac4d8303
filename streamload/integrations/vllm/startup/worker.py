"""The vLLM worker loading the model now (`worker_loading`), and the name of its method that compiles
and warms up (`METHOD`), where overlap.py and recorded.py leave their one-shot hooks."""

from __future__ import annotations

import sys
from typing import Any

METHOD = "compile_or_warm_up_model"


def worker_loading() -> Any:
    """The vLLM worker whose `load_model` is on the stack (the loader is called from its model runner)."""
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker is one too

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Worker):
            return candidate
        frame = frame.f_back
    return None
