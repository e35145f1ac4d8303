"""Cold start to first token: process start -> config -> model -> weights -> (compile) -> first token.

One process, one path (`--mode`), timed from the moment the process was started:

  transformers  `AutoModelForCausalLM.from_pretrained`, then `generate` (eager);
  streamload    `streamload.from_pretrained`, then `generate` (eager);
  sequential    `streamload.from_pretrained`, then compile and warm up every decoder layer, then
                `generate`: what a server does when loading and compiling are separate steps;
  overlapped    `streamload.from_pretrained(on_layer=...)`: each decoder layer is compiled and warmed
                up on a worker thread as soon as its weights are in, while later layers still load.

"Warm up" runs a layer with exactly the inputs that `generate`'s first pass gives it, so the first
token needs no further compilation (the process reports how many graphs `generate` still compiled).
`bench/first_token.py` runs all four in fresh processes with an empty compile cache and a cold page
cache and prints the table in docs/benchmarks.md.

    pip install -e ".[transformers]"
    python bench/first_token.py --make /tmp/llama-first-token        # writes a small Llama checkpoint
    python examples/first_token.py /tmp/llama-first-token --mode overlapped
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: they are part of a cold start

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import streamload  # noqa: E402

MODES = ("transformers", "streamload", "sequential", "overlapped")
PROMPT_TOKENS = 32


class LayerWarmer:
    """Compiles and runs each decoder layer with the inputs of `generate`'s first (prefill) pass.

    The inputs are built once from the model's own rotary embedding and config (a Llama-family
    decoder layer: Llama, Mistral, Qwen2, ...). One KV cache is shared by all warm-ups so that layer i
    sees the cache as it will in the real pass (layers < i already filled).
    """

    def __init__(self, model: nn.Module, device: torch.device, prompt_tokens: int, backend: str = "inductor") -> None:
        import torch._dynamo  # only the compiling modes pay for importing the compiler
        from transformers import DynamicCache

        # A decoder layer's index is an int attribute that the KV cache update reads; dynamo would
        # specialise on it and compile every layer from scratch. Dynamic, layers 1..N reuse layer 0's code.
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        config = model.config
        # Still, the KV cache guards on its layer's entry (`cache.layers[i].is_initialized`), so each
        # layer compiles a graph of its own, as in generate's own first pass: past dynamo's recompile
        # limit (8) the later layers would silently run uncompiled. Room for every layer (set in the
        # thread that compiles: dynamo's config, set on another thread, is not seen there).
        self.recompile_limit = config.num_hidden_layers + 8
        rotary = copy.deepcopy(model.model.rotary_emb).to(device)  # the model's own stays on the CPU until loaded
        hidden = torch.zeros(1, prompt_tokens, config.hidden_size, dtype=model.dtype, device=device)
        positions = torch.arange(prompt_tokens, device=device)[None]
        self.hidden = hidden
        self.kwargs = {
            "attention_mask": None,  # what the causal mask builder gives an unpadded prompt
            "position_embeddings": rotary(hidden, positions),
            "position_ids": positions,
            "past_key_values": DynamicCache(config=config),
            "use_cache": True,
        }
        self.device = device
        self.backend = backend

    @torch.no_grad()
    def __call__(self, layer: nn.Module) -> None:
        import torch._dynamo

        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), self.recompile_limit))
        layer.eval()  # generate runs in eval mode; a warm-up in train mode would compile another graph
        layer.compile(backend=self.backend)
        layer(self.hidden, **self.kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run(path: str, mode: str, device: torch.device, backend: str = "inductor") -> dict[str, float | int | str]:
    """Takes one path to the first token; returns when each stage ended, in seconds since start."""
    from transformers import AutoModelForCausalLM

    t0 = float(os.environ.get("FIRST_TOKEN_T0", STARTED))
    stamp: dict[str, float | int | str] = {"mode": mode}

    def mark(stage: str) -> None:
        _sync(device)
        stamp.setdefault(stage, time.time() - t0)

    mark("imported")
    if mode == "transformers":
        placed = {} if device.type == "cpu" else {"device_map": device}  # device_map needs accelerate
        model = AutoModelForCausalLM.from_pretrained(path, **placed).eval()
    elif mode in ("streamload", "sequential"):
        model = streamload.from_pretrained(path, device=device)
    elif mode == "overlapped":
        model = _overlapped(path, device, backend, mark)
    else:
        raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    mark("weights")
    if mode == "sequential":
        warm = LayerWarmer(model, device, PROMPT_TOKENS, backend)
        for layer in model.model.layers:
            warm(layer)
    mark("compiled")
    stamp["graphs"] = graphs = _graphs()
    prompt = torch.arange(PROMPT_TOKENS, device=device)[None] % model.config.vocab_size
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False)
    mark("first_token")
    stamp["compiled_in_generate"] = _graphs() - graphs
    stamp["token"] = int(out[0, -1])
    return stamp


def _overlapped(path: str, device: torch.device, backend: str, mark: Callable[[str], None]) -> nn.Module:
    """The steps of `streamload.from_pretrained`, spelled out so that the warm-up inputs can be built
    before the first weight arrives: config -> model with parameters on meta -> weights streamed in,
    each finished decoder layer handed to a compile thread (one thread, so layers warm up in order;
    the load never waits for the compiler)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with streamload.empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    warm = LayerWarmer(model, device, PROMPT_TOKENS, backend)
    pending: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="compile") as compiler:

        def on_layer(key: str, layer: nn.Module | None) -> None:
            if layer is not None and key.startswith("model.layers."):
                pending.append(compiler.submit(warm, layer))

        streamload.load_into(model, path, device=device, on_layer=on_layer)
        mark("weights")  # all weights in; warm-ups may still be running
    for done in pending:
        done.result()  # a warm-up's error surfaces here
    return model.to(device).eval()  # buffers made by the constructor; parameters are there already


def _graphs() -> int:
    """How many graphs dynamo has compiled in this process (0 when the compiler was never imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a transformers checkpoint directory (config.json + safetensors)")
    ap.add_argument("--mode", choices=MODES, default="overlapped", help="default: %(default)s")
    ap.add_argument("--device", default="cpu", help="default: %(default)s")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default: %(default)s)")
    args = ap.parse_args()
    print(json.dumps(run(args.checkpoint, args.mode, torch.device(args.device), args.backend)))


if __name__ == "__main__":
    main()
