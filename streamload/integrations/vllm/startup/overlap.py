"""Compile and warm up while the weights arrive (`model_loader_extra_config={"overlap": True}`).

vLLM compiles only after `load_weights` returns, after the last byte: a node pays the download and the
compilation one after the other. Compilation does not depend on the weights' values (vLLM freezes none;
its compile cache is keyed on configuration and code), so in this mode the first load returns at once
and the fetch started with the engine goes on while the worker profiles, compiles and warms up. At the
end of the worker's `compile_or_warm_up_model` (before it reports ready, so no request sees them) the
weights are loaded through vLLM's own in-place layerwise reload: each layer is built anew on its real
bytes, processed, and its results copied into the storage the compiled code and graphs hold (what a
layer keeps outside its parameters, the CPU's packed GEMM closures, is the one that processing made).

What it costs: the parameters' values are unset during the profile run (its numbers are discarded);
their pages are touched first so that a CPU worker's RSS-based sizing counts them; the final pass reads
the staged files once more than a plain load would. Refused, with a reason (`refusal`), where exactness
is not checked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload.base.errors import UnsupportedError
from streamload.base.gc_pause import collector_paused
from streamload.device import KINDS
from streamload.integrations.vllm import restore
from streamload.integrations.vllm.feed import feed, load_weights_from
from streamload.integrations.vllm.files import Part
from streamload.integrations.vllm.ranks import tp_rank_world
from streamload.integrations.vllm.report import last_load, record
from streamload.integrations.vllm.startup.worker import METHOD, worker_loading

if TYPE_CHECKING:
    from vllm.config import ModelConfig

    from streamload.integrations.vllm.state import LoadState

log = logging.getLogger("vllm.streamload")

CHECKED_VLLM = ("0.32.0",)  # the versions whose worker order and layerwise reload this mode was checked on


def refusal(model: nn.Module, model_config: Any, worker: Any) -> str:
    """Why this mode cannot be exact here, or "" where it is."""
    import vllm
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    if vllm.__version__ not in CHECKED_VLLM:
        return f"it is checked on vLLM {', '.join(CHECKED_VLLM)} only, and this is vLLM {vllm.__version__}"
    if worker is None:
        return "the model is not being loaded by a vLLM CPU or GPU worker"
    if getattr(model_config, "quantization", None) is not None:
        return f"the model is quantized ({model_config.quantization}): only unquantized models are checked"
    if getattr(worker.vllm_config.model_config, "enable_sleep_mode", False):
        return "sleep mode keeps the weights in a memory pool of their own"
    if getattr(worker.vllm_config, "speculative_config", None) is not None:
        return "speculative decoding: its drafter is built and compared with the model before the weights are in"
    kind = KINDS.get(str(worker.device_config.device_type))  # None: a type streamload does not serve
    if kind is not None and kind.host_memory and any(isinstance(m, RoutedExperts) for m in model.modules()):
        # vLLM 0.32's in-place reload copies a CPU MoE's new experts over their prepacked layout without
        # prepacking them (UnquantizedFusedMoEMethod._setup_kernel runs the experts' processing on the
        # first load only): its own reload_weights serves other tokens (tests/test_vllm.py)
        return "vLLM's in-place reload of mixture-of-experts layers on the CPU is not exact"
    return ""


def defer(model: nn.Module, model_config: Any, finish: Callable[[], None]) -> None:
    """`finish()` (the weights' load) run at the end of this worker's `compile_or_warm_up_model` (the
    hook is the worker's own attribute, removed when it has run)."""
    worker = worker_loading()
    if why := refusal(model, model_config, worker):
        raise UnsupportedError(f"streamload: model_loader_extra_config 'overlap' cannot be used: {why}")
    touch(model)
    warm_up = getattr(worker, METHOD)

    def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
        try:
            result = warm_up(*args, **kwargs)
            log.info("streamload: compiled and warmed up; loading the weights in place")
            finish()
            return result
        finally:
            vars(worker).pop(METHOD, None)

    setattr(worker, METHOD, compile_or_warm_up_model)
    log.info("streamload: compiling and warming up while the weights arrive (overlap)")


@torch.no_grad()
def touch(model: nn.Module) -> None:
    """Fault in every page of the host-memory parameters without changing a byte, so that the memory a
    CPU worker measures (its RSS) counts them as if they had been loaded."""
    page = 4096
    for p in model.parameters():
        if not p.is_cpu or not p.is_contiguous() or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1).view(torch.uint8)
        flat[::page] = flat[::page].clone()


@collector_paused
def load_in_place(state: LoadState, model: nn.Module, model_config: ModelConfig, parts: list[Part] | None) -> None:
    """The first load's weights, after compilation (`defer`'s `finish`): whole tensors through vLLM's
    in-place layerwise reload."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    start = time.perf_counter()
    options, state.stats = state.stream_options(model), []
    parts = parts if parts is not None else state.parts(model_config, model, first=True)
    last_load.plan_seconds = time.perf_counter() - start
    initialize_layerwise_reload(model)
    result = load_weights_from(model, feed(parts, options, state.stats))
    finalize_layerwise_reload(model, model_config)
    state.track_weights(model, model_config, result)  # a weight the checkpoint lacks: vLLM's error
    record(parts, state.stats, None, tp_rank_world()[1])
    last_load.seconds = time.perf_counter() - start
    log.info(
        "streamload: %.1f MB read by the %s reader into the compiled model in %.2f s",
        last_load.bytes_read / 1e6,
        last_load.reader or "no",
        last_load.seconds,
    )
    restore.SERVED[model] = state.served(model_config, parts)
