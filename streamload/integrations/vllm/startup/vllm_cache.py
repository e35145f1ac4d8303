"""Where vLLM keeps what torch.compile made: its cache root (`VLLM_CACHE_ROOT`) and the folder in it
(`CACHE`), as compiled.py publishes and installs from it and recorded.py records in it."""

from __future__ import annotations

from pathlib import Path

CACHE = "torch_compile_cache"


def cache_root() -> Path:
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT)
