"""What the integration does while a vLLM engine starts, before and around its first load: fetching
the weights (`ahead.py`), installing published compiled artifacts (`install_compiled.py`,
`compiled.py`, `unpack.py`, `recorded.py`), and compiling while the weights arrive (`overlap.py`)."""
