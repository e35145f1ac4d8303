"""Load a Hugging Face `transformers` model with `streamload.from_pretrained`: no hand edits.

A small Llama config with random weights is saved with `save_pretrained` as sharded safetensors;
the same directory is then loaded (a) with transformers' `from_pretrained` and (b) with
`streamload.from_pretrained` (the model built with its parameters on the meta device and its buffers
for real, the weights streamed in layer by layer). Outputs must be identical.

    pip install -e ".[transformers]"
    python examples/transformers_model.py
"""

from __future__ import annotations

import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import streamload


def main() -> None:
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4000, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="streamload-hf-") as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp, max_shard_size="2MB")

        t = time.perf_counter()
        reference = AutoModelForCausalLM.from_pretrained(tmp).eval()
        hf_s = time.perf_counter() - t

        t = time.perf_counter()
        layers_seen: list[str] = []
        model = streamload.from_pretrained(tmp, device="cpu", on_layer=lambda key, layer: layers_seen.append(key))
        ours_s = time.perf_counter() - t

    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        same = torch.equal(model(ids).logits, reference(ids).logits)
    print(f"transformers from_pretrained {hf_s * 1e3:.0f} ms, streamload.from_pretrained {ours_s * 1e3:.0f} ms")
    print(f"layers handed to on_layer as they completed: {layers_seen}")
    print(f"outputs identical: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
