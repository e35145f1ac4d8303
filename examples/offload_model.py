"""Run a model larger than its memory budget with `streamload.offload`.

A Llama checkpoint is saved with `save_pretrained`; the model is built on the meta device and run
with a third of its weights' size as budget: the embeddings and head stay resident, and the decoder
layers stream in through the loader one layer ahead of the one that runs. The generated tokens are
compared with those of the model loaded whole.

    pip install -e ".[transformers]"
    python examples/offload_model.py                      # CPU; on a GPU: --device cuda [--host-cache]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import streamload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="default: %(default)s")
    ap.add_argument("--host-cache", action="store_true", help="(GPU) stream from pinned host copies")
    ap.add_argument("--share", type=float, default=1 / 3, help="budget / weights (default: %(default).2f)")
    args = ap.parse_args()
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=16, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4000, tie_word_embeddings=False)  # fmt: skip
    prompt = torch.arange(24, device=args.device)[None]
    with tempfile.TemporaryDirectory(prefix="streamload-offload-") as path:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="20MB")
        total = streamload.inspect(path).nbytes
        budget = int(total * args.share)

        whole = streamload.from_pretrained(path, device=args.device)
        with torch.no_grad():
            want = whole.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
        del whole

        with streamload.empty_weights():
            model = AutoModelForCausalLM.from_config(config).eval()
        with streamload.offload(
            model, path, device=args.device, budget_bytes=budget, host_cache=args.host_cache
        ) as off:
            start = time.perf_counter()
            with torch.no_grad():
                got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
            seconds = time.perf_counter() - start
            s = off.stats
    print(
        f"weights {total / 1e6:.0f} MB, budget {budget / 1e6:.0f} MB: {s.resident_blocks} layers resident, "
        f"{s.offloaded_blocks} streamed ({s.fetches} fetches), peak {s.peak_bytes / 1e6:.0f} MB of weights held"
    )
    print(
        f"16 tokens in {seconds:.2f} s; waited {s.waited_s:.2f} s for layers; same tokens as the whole model: "
        f"{torch.equal(got, want)}"
    )
    if not torch.equal(got, want):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
