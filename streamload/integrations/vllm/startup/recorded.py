"""Which compiled folder a model's engine used, recorded in vLLM's cache root once its worker compiled.

vLLM names its compiled folders by hashes of its whole configuration, and the folder a run used is
known only inside the worker, once it has compiled. So the first load of an engine leaves a one-shot
hook on its worker's `compile_or_warm_up_model` that writes `<cache root>/streamload-compiled/<folder's
digest>.json`: {"model": the checkpoint, "folder": the folder under `torch_compile_cache`}, for
`compile-cache publish` to pack that checkpoint's folders alone. Ranks of one engine write the same
record (atomically); a record whose folder is gone is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from streamload.base import atomic
from streamload.integrations.vllm.startup.worker import METHOD, worker_loading

log = logging.getLogger("vllm.streamload")

CACHE = "torch_compile_cache"  # what torch.compile made, in vLLM's cache root
RECORDS = "streamload-compiled"
_INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"


def after_compiling(model: str) -> None:
    """Record, once the worker loading now has compiled, the folder it compiled `model` into."""
    worker = worker_loading()
    if worker is None:
        return
    warm_up = getattr(worker, METHOD)

    def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
        inductor = os.environ.get(_INDUCTOR)
        try:
            result = warm_up(*args, **kwargs)
        finally:
            vars(worker).pop(METHOD, None)
        # Ahead-of-time compilation sets the folder (`torch_aot_compile/<hash>`, Inductor's cache in it,
        # process-wide) and, compiling cold, its backend then names the graph cache's: both are the model's.
        used = [getattr(worker.vllm_config.compilation_config, "local_cache_dir", None)]
        if os.environ.get(_INDUCTOR) != inductor:
            used.append(os.path.dirname(os.environ.get(_INDUCTOR, "")))
        for folder in filter(None, used):
            try:
                record(model, folder)
            except (OSError, ValueError) as exc:  # a record is a convenience for publishing: the engine runs on
                log.warning("streamload: could not record the compiled folder %s of %s: %s", folder, model, exc)
        return result

    setattr(worker, METHOD, compile_or_warm_up_model)


def record(model: str, local_cache_dir: str, root: str | Path | None = None) -> Path:
    """Write the record that `model` compiled into `local_cache_dir` (a folder of `root`'s compile cache,
    default: vLLM's cache root; else ValueError)."""
    root = Path(root) if root is not None else cache_root()
    inside = Path(local_cache_dir).resolve().relative_to((root / CACHE).resolve()).parts
    if not inside or (inside[:1] == ("torch_aot_compile",) and len(inside) < 2):
        raise ValueError(f"{local_cache_dir} is not a compiled folder of {root / CACHE}")
    folder = "/".join(inside[:2] if inside[0] == "torch_aot_compile" else inside[:1])
    name = hashlib.sha256(folder.encode()).hexdigest()[:16] + ".json"
    (root / RECORDS).mkdir(parents=True, exist_ok=True)
    atomic.write(root / RECORDS / name, json.dumps({"model": _named(model), "folder": folder}).encode())
    return root / RECORDS / name


def recorded(checkpoint: str | Path, root: str | Path | None = None) -> list[str]:
    """The compiled folders (under `torch_compile_cache`) recorded for `checkpoint` that `root` still has."""
    root = Path(root) if root is not None else cache_root()
    wanted, out = _named(str(checkpoint)), set()
    for path in sorted((root / RECORDS).glob("*.json")) if (root / RECORDS).is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            model, folder = entry["model"], entry["folder"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # another writer's, unfinished records cannot be seen (atomic): a damaged one is skipped
        if model == wanted and isinstance(folder, str) and _within(root / CACHE, folder):
            out.add(folder)
    return sorted(out)


def cache_root() -> Path:
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT)


def _within(cache: Path, folder: str) -> bool:
    """Whether `folder` names a folder inside `cache` (not an absolute path, nor one leading out)."""
    path = cache / folder
    try:
        return not Path(folder).is_absolute() and path.resolve().is_relative_to(cache.resolve()) and path.is_dir()
    except OSError:
        return False


def _named(model: str) -> str:
    """A checkpoint as records name it: a local folder by its absolute path, anything else as given."""
    return model if "://" in model else str(Path(model).resolve())
