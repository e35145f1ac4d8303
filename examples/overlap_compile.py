"""Warm each layer up while later layers are still loading, and measure what that saves.

A llama-shaped model is built on the meta device (no memory, no init), its random weights are saved
as sharded safetensors, and then, from a cold page cache each time:

  sequential: `load_into(model)`, then warm up every layer;
  overlapped: `load_into(model, on_layer=warm_up)`: layer i warms up while layers > i load.

"Warm-up" runs each layer's forward once (`--compile` puts `torch.compile` in front, which on a GPU
is where most of a server's start-up goes); its batch is calibrated so that warming all layers takes
about as long as loading them.

    python examples/overlap_compile.py                 # ~0.5 GB, CPU
    python examples/overlap_compile.py --layers 20     # ~1.3 GB
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import streamload
from streamload.bench import evict


class Block(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.post_attention_layernorm = nn.RMSNorm(d)
        self.gate_proj, self.up_proj = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        x = x + self.o_proj(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Model(nn.Module):
    def __init__(self, d: int, ffn: int, layers: int, vocab: int = 32000) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer before warming it up")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for the warm-up")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def fresh() -> Model:
        with torch.device("meta"):
            return Model(args.hidden, args.ffn, args.layers)

    tokens = 128

    def warm_up(key: str, layer: nn.Module | None) -> None:
        assert layer is not None
        run = torch.compile(layer) if args.compile else layer
        with torch.no_grad():
            run(torch.randn(1, tokens, args.hidden, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with tempfile.TemporaryDirectory(prefix="streamload-overlap-") as tmp:
        directory = Path(tmp)
        from huggingface_hub import save_torch_state_dict

        model = Model(args.hidden, args.ffn, args.layers)  # random weights, on the CPU, to save
        save_torch_state_dict(model.state_dict(), directory, max_shard_size="300MB")
        total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        del model

        # Calibrate (after one untimed round of each): warm-up passes so that warming all layers
        # takes about as long as a cold load.
        for _ in range(2):
            evict(str(f) for f in directory.glob("*.safetensors"))
            t = time.perf_counter()
            model = fresh()
            streamload.load_into(model, directory, device=device)
            load_s = time.perf_counter() - t
            t = time.perf_counter()
            warm_up("layers.0", model.layers[0])
            one = time.perf_counter() - t
        tokens = max(1, round(tokens * load_s / args.layers / one))  # warm-up time ~ tokens
        t = time.perf_counter()
        for layer in model.layers:
            warm_up("", layer)
        warm_s = time.perf_counter() - t
        print(f"{total / 1e9:.2f} GB, {args.layers} layers; cold load {load_s:.2f} s; "
              f"warm-up of {tokens} tokens per layer: {warm_s:.2f} s in all")  # fmt: skip

        sequential, overlapped, first_layer = [], [], []
        for _ in range(args.runs):
            evict(str(f) for f in directory.glob("*.safetensors"))
            t = time.perf_counter()
            model = fresh()
            streamload.load_into(model, directory, device=device)
            for i, layer in enumerate(model.layers):
                warm_up(f"layers.{i}", layer)
            sequential.append(time.perf_counter() - t)

            evict(str(f) for f in directory.glob("*.safetensors"))
            t = time.perf_counter()
            model = fresh()
            seen: list[float] = []

            def hook(key: str, layer: nn.Module | None, seen: list[float] = seen, t: float = t) -> None:
                seen.append(time.perf_counter() - t)
                warm_up(key, layer)

            streamload.load_into(model, directory, device=device, on_layer=hook)
            overlapped.append(time.perf_counter() - t)
            first_layer.append(seen[0])

    seq, ovl, first = (sorted(v)[len(v) // 2] for v in (sequential, overlapped, first_layer))
    print(f"sequential (load, then warm up): {seq:.2f} s")
    print(f"overlapped (warm up in on_layer): {ovl:.2f} s = {ovl / seq:.2f}x")
    print(f"first layer ready after {first * 1e3:.0f} ms ({first / ovl:.0%} of the overlapped run)")


if __name__ == "__main__":
    main()
