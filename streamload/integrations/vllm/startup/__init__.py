"""What the integration does while a vLLM engine starts, before and around its first load: fetching
the weights from where vLLM builds the load config (`ahead.py`), installing published compiled
artifacts while the weights load (`install_compiled.py`, `compiled.py`, `unpack.py`; where vLLM keeps
them: `vllm_cache.py`), and compiling while the weights arrive, loading them in place after
(`overlap.py`; the worker's hook it and `recorded.py` use: `worker.py`)."""
