"""Load a Hugging Face `transformers` model with `streamload.from_pretrained`: no hand edits.

With no argument, a small Llama config with random weights is saved with `save_pretrained` as
sharded safetensors; with PATH, that model folder (config.json + safetensors) is used instead. The
folder is loaded (a) with `streamload.from_pretrained` (the model built with its parameters on the
meta device and its buffers for real, the weights streamed in layer by layer) and (b) with
transformers' own `from_pretrained`. Every weight and the outputs must be identical.

    pip install -e ".[transformers]"
    python examples/transformers_model.py [PATH]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

import streamload


def small_llama(folder: Path) -> Path:
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4000, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="2MB")
    return folder


def placed(model: nn.Module) -> nn.Module:
    """transformers keeps weights as views of the file, at its 8-byte alignment, where CPU kernels may
    sum in another order; streamload places them as torch does. Compare outputs with that layout."""
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                p.data = p.data.clone()
    return model


def compare(folder: Path) -> bool:
    t = time.perf_counter()
    layers_seen: list[str] = []
    model = streamload.from_pretrained(folder, device="cpu", on_layer=lambda key, layer: layers_seen.append(key))
    ours_s = time.perf_counter() - t

    t = time.perf_counter()
    reference = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype).eval()
    hf_s = time.perf_counter() - t

    want = reference.state_dict()
    weights_same = model.state_dict().keys() == want.keys() and all(
        torch.equal(t, want[k]) for k, t in model.state_dict().items()
    )
    vocab = getattr(model.config, "vocab_size", None) or 100
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(input_ids=ids), placed(reference)(input_ids=ids)
    key = "logits" if "logits" in ours else "last_hidden_state"
    outputs_same = torch.equal(ours[key], theirs[key])
    print(f"{folder}: {type(model).__name__}")
    print(f"streamload.from_pretrained {ours_s * 1e3:.0f} ms, transformers from_pretrained {hf_s * 1e3:.0f} ms")
    print(f"layers handed to on_layer as they completed: {len(layers_seen)} ({', '.join(layers_seen[:3])}, ...)")
    print(f"weights identical: {weights_same}, outputs ({key}) identical: {outputs_same}")
    return weights_same and outputs_same


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        ok = compare(Path(argv[1]))
    else:
        with tempfile.TemporaryDirectory(prefix="streamload-hf-") as tmp:
            ok = compare(small_llama(Path(tmp)))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv)
