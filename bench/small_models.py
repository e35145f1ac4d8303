"""Small dense models, warm: `streamload.from_pretrained` against transformers' own, and a load of the
weights alone against `safetensors.torch.load_file`, each reader.

A fixed cost shows on a small model where a big one hides it. Two layouts of each checkpoint: as
`save_pretrained` writes it, and with every tensor 8 bytes past 64-byte alignment (safetensors aligns to 8;
checkpoints written by other tools sit so, all-MiniLM-L6-v2's among them). The loaders take turns in one
process, warm page cache, after one untimed load each; median of `--runs`.

    python bench/small_models.py /tmp/small-models --make      # once: BERT (MiniLM-L6 sized) and a Llama
    python bench/small_models.py /tmp/small-models --runs 15
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MODELS = ("minilm-l6", "llama-120m")


def make(root: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    bert = transformers.BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    )  # fmt: skip  (all-MiniLM-L6-v2's shape)
    llama = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                                     num_attention_heads=12, num_key_value_heads=4)  # fmt: skip
    built = {"minilm-l6": transformers.BertModel(bert), "llama-120m": transformers.LlamaForCausalLM(llama)}
    for name, model in built.items():
        model.save_pretrained(root / name)
        _unaligned(root / name, root / f"{name}-unaligned")
        size = (root / name / "model.safetensors").stat().st_size
        print(f"wrote {root / name} (+ -unaligned): {size / 1e6:.0f} MB")


def _unaligned(src: Path, dst: Path) -> None:
    """A copy whose tensors all sit at 8 modulo 64 (the header padded)."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    data = (src / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].rstrip(b" ")
    header += b" " * ((8 - (8 + len(header))) % 64)
    (dst / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])


def _median(fn: Callable[[], object], runs: int) -> float:
    fn()  # untimed: imports, first-call caches
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _read_owned(path: str) -> object:
    """The floor of any reader that hands out owned memory: the file read once into one new allocation."""
    import torch

    with open(path, "rb", buffering=0) as f:
        memory = torch.empty(Path(path).stat().st_size, dtype=torch.uint8)
        f.readinto(memoryview(memory.numpy()))
    return memory


def measure(folder: Path, runs: int) -> dict[str, float]:
    import safetensors.torch
    import transformers
    from transformers.utils import logging

    import streamload

    logging.disable_progress_bar()
    weights = str(folder / "model.safetensors")
    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(folder).architectures[0])
    loaders: dict[str, Callable[[], object]] = {
        "transformers.from_pretrained": lambda: cls.from_pretrained(folder),
        "streamload.from_pretrained": lambda: streamload.from_pretrained(folder, device="cpu"),
        "load_file": lambda: safetensors.torch.load_file(weights),
        "streamload.load mmap": lambda: streamload.load(weights, device="cpu", reader="mmap"),
        "streamload.load posix": lambda: streamload.load(weights, device="cpu", reader="posix"),
        "read into new memory": lambda: _read_owned(weights),
    }
    return {name: _median(fn, runs) for name, fn in loaders.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--make", action="store_true", help="write the checkpoints and exit")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this folder, print one line
    args = parser.parse_args()
    if args.make:
        make(args.root)
        return
    if args.one:
        print(json.dumps(measure(args.root / args.one, args.runs)))
        return
    print("| checkpoint | MB | transformers | streamload | ratio | load_file | mmap (- load_file) | posix (- load_file)"
          " | read into new memory |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        for layout in (name, f"{name}-unaligned"):
            out = subprocess.run([sys.executable, __file__, str(args.root), "--one", layout, "--runs", str(args.runs)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            t = json.loads(out.strip().splitlines()[-1])
            size = (args.root / layout / "model.safetensors").stat().st_size / 1e6
            ms = {k: v * 1e3 for k, v in t.items()}
            base = ms["load_file"]
            print(f"| {layout} | {size:.0f} | {ms['transformers.from_pretrained']:.1f} ms | "
                  f"{ms['streamload.from_pretrained']:.1f} ms | "
                  f"{t['streamload.from_pretrained'] / t['transformers.from_pretrained']:.2f}x | {base:.1f} ms | "
                  f"{ms['streamload.load mmap']:.1f} ms (+{ms['streamload.load mmap'] - base:.1f}) | "
                  f"{ms['streamload.load posix']:.1f} ms (+{ms['streamload.load posix'] - base:.1f}) | "
                  f"{ms['read into new memory']:.1f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
