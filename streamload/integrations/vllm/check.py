"""Check the "streamload" load format on your own architecture: `streamload vllm-check MODEL [--tp N]`.

The model is loaded twice by real vLLM engines, once with vLLM's default loader and once with
streamload, and every parameter and buffer is compared byte for byte on every tensor-parallel rank
right after `load_weights`, before vLLM post-processes the weights (on CPU its linear layers hand their
weights to oneDNN and leave the parameters empty). How the tensors are seen: `STREAMLOAD_VLLM_CHECK=DIR`
in a vLLM process makes streamload's plugin wrap vLLM's `process_weights_after_loading`, writing each
rank's tensors' digests to DIR first.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamload.base import settings
from streamload.base.errors import MissingFileError, SourceError

ENV = settings.VLLM_CHECK.name
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def install() -> None:
    """Wrap vLLM's `process_weights_after_loading` so that each rank writes its tensors' digests to
    `$STREAMLOAD_VLLM_CHECK` first; nothing when it is unset."""
    if not settings.VLLM_CHECK.get():
        return
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "streamload_check", False):
        return

    def process_weights_after_loading(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if out := settings.VLLM_CHECK.get():  # unset again after a check: later loads in this process go on as usual
            _write(model, Path(out))
        return original(model, *args, **kwargs)

    process_weights_after_loading.streamload_check = True  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = process_weights_after_loading


def _write(model: torch.nn.Module, out: Path) -> None:
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({name: _describe(t) for name, t in tensors.items()}))


def _describe(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's digest, and enough of its values to say how two of them differ."""
    if t.is_meta:
        return {"shape": list(t.shape), "dtype": str(t.dtype), "sha256": "meta"}
    flat = t.detach().cpu().contiguous().reshape(-1)
    values = (flat.abs() if flat.dtype.is_complex else flat).double()
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "sha256": hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest(),
        "sum": float(values.sum()),
        "first": [float(v) for v in values[:4]],
    }


@dataclass
class Report:
    """What `check` found: per rank, the tensors of the two loads that differ (empty: identical)."""

    model: str
    tp: int
    tensors: int = 0  # per rank
    differences: list[str] = field(default_factory=list)  # one line each, first difference first
    streamload: dict[str, Any] = field(default_factory=dict)  # what streamload's load reported (rank 0)

    @property
    def ok(self) -> bool:
        return not self.differences

    def __str__(self) -> str:
        if self.ok:
            return (
                f"streamload and vLLM's default loader agree: {self.tp} rank{'s' if self.tp > 1 else ''}, "
                f"{self.tensors} tensors each, byte for byte"
            )
        head = f"streamload differs from vLLM's default loader in {len(self.differences)} tensor(s); first: "
        return head + self.differences[0] + "".join(f"\n  {d}" for d in self.differences[1:10])


def check(model: str, tp: int = 1, **engine: Any) -> Report:
    """Load `model` with vLLM's default loader and with streamload (each in a real engine, `tp` ranks)
    and compare every tensor on every rank right after `load_weights`. `engine`: more `vllm.LLM`
    arguments (`dtype`, `model_loader_extra_config` for streamload's options, `runner`, ...)."""
    extra = engine.pop("model_loader_extra_config", None) or {}
    return check_modes(model, {"": extra}, tp, **engine)[""]


def check_modes(model: str, modes: dict[str, dict[str, Any]], tp: int = 1, **engine: Any) -> dict[str, Report]:
    """`check` for several sets of streamload's options (`model_loader_extra_config`, by a name of
    your choosing), against one load by vLLM's default loader."""
    _exists(model)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process where one rank
    engine = {**_cpu_defaults(engine), **engine}
    with tempfile.TemporaryDirectory(prefix="streamload-check-") as tmp:
        reference, _ = _seen(model, "auto", tp, {}, engine, Path(tmp) / "auto")  # vLLM's default loader
        reports = {}
        for name, extra in modes.items():
            loader = {"model_loader_extra_config": extra}
            ours, state = _seen(model, "streamload", tp, loader, engine, Path(tmp) / "ours")
            reports[name] = Report(model, tp, len(reference[0]), compare(reference, ours), state)
    return reports


def _seen(
    model: str, fmt: str, tp: int, loader: dict[str, Any], engine: dict[str, Any], out: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank's tensors right after `load_weights` by the `fmt` loader, and what streamload reported."""
    shutil.rmtree(out, ignore_errors=True)
    settings.VLLM_CHECK.put(str(out))
    install()  # in this process too (its plugins may have loaded before)
    try:
        state = _run(model, fmt, tp, loader, engine)
    finally:
        settings.VLLM_CHECK.clear()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)], state


def _exists(model: str) -> None:
    """A local directory, or a Hugging Face model id: anything else is refused in one line before vLLM
    is imported (it would answer a mistyped path with a traceback about repo ids)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise SourceError(f"{model}: not a model directory (a folder with config.json and the weights)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise MissingFileError(f"{model}: no such directory (nor a Hugging Face model id)") from None


# What the engines need on a CPU: the check runs 256 tokens at most, but vLLM's CPU worker otherwise
# reserves 92% of the machine's memory for its KV cache and refuses to start where less is free.
CPU_KV_CACHE_BYTES = 1 << 30


def _cpu_defaults(engine: dict[str, Any]) -> dict[str, Any]:
    """vllm.LLM arguments for a CPU where VLLM_CPU_KVCACHE_SPACE is unset and no KV cache size is chosen."""
    chosen = ("kv_cache_memory_bytes", "gpu_memory_utilization")
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") or any(k in engine for k in chosen):
        return {}
    from vllm.platforms import current_platform

    return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES} if current_platform.is_cpu() else {}


def compare(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[str]:
    """One line per tensor that differs between vLLM's load (`theirs`, rank by rank) and streamload's."""
    differences = []
    for rank, (a_rank, b_rank) in enumerate(zip(theirs, ours, strict=True)):
        where = f"rank {rank}: " if len(theirs) > 1 else ""
        for name in sorted(a_rank.keys() | b_rank.keys()):
            a, b = a_rank.get(name), b_rank.get(name)
            if a is None or b is None:
                differences.append(f"{where}{name!r} only in {'streamload' if a is None else 'vLLM'}'s model")
            elif a != b:
                differences.append(f"{where}{name!r} {_what(a, b)}")
    return differences


def _what(a: dict[str, Any], b: dict[str, Any]) -> str:
    if (a["shape"], a["dtype"]) != (b["shape"], b["dtype"]):
        return f"is {b['dtype']}{b['shape']} through streamload, {a['dtype']}{a['shape']} through vLLM"
    return (
        f"{a['dtype']}{a['shape']}: sum {b.get('sum')} through streamload, {a.get('sum')} through vLLM; "
        f"first values {b.get('first')} against {a.get('first')}"
    )


def _run(model: str, fmt: str, tp: int, loader: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    no_tokenizer = Path(model).is_dir() and not any((Path(model) / f).exists() for f in _TOKENIZER_FILES)
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": no_tokenizer,
        "enforce_eager": True,
        "max_model_len": 256,
        **engine,
    }
    if tp > 1:
        kwargs.setdefault("distributed_executor_backend", "mp")
    llm = LLM(model=model, load_format=fmt, tensor_parallel_size=tp, **loader, **kwargs)
    try:
        from streamload.integrations.vllm.report import last_load

        return dict(vars(last_load)) if tp == 1 else {}
    finally:
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
        gc.collect()
