"""vLLM's load formats side by side: the weight-loading time vLLM logs, time to a ready engine and to
the first token, from a fresh process per run, cold (checkpoint evicted from the page cache) and warm.

Formats: streamload, vLLM's default safetensors loader (lazy), safetensors with
`safetensors_load_strategy="prefetch"`, fastsafetensors and runai_streamer — each where it runs (the
CPU build of vLLM cannot run fastsafetensors, which loads into CUDA). The formats take turns, so drift
on a noisy machine hits all alike; medians are reported, with ratios to the default loader.

    python bench/vllm.py --make /tmp/llama-vllm        # once: a ~1 GB bf16 Llama (config + shards)
    python bench/vllm.py /tmp/llama-vllm --runs 3 --json docs/bench-vllm-cpu.json
    python bench/vllm.py MODEL --tp 2                  # tensor parallel: bytes read per rank too
    python bench/vllm.py --make /tmp/q --quantized w8a8-int8   # a 0.89 GB compressed-tensors W8A8 int8 Llama
    python bench/vllm.py MODEL --tp 2 --reload --modes warm --formats streamload,safetensors   # reloads

A run is `python bench/vllm.py --one FORMAT MODEL`: it prints one JSON line of its timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder leads sys.path and this file would shadow the vllm package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

FORMATS: dict[str, dict[str, Any]] = {
    "streamload": {"load_format": "streamload"},
    "safetensors": {"load_format": "safetensors"},
    "prefetch": {"load_format": "safetensors", "safetensors_load_strategy": "prefetch"},
    "fastsafetensors": {"load_format": "fastsafetensors"},
    "runai_streamer": {"load_format": "runai_streamer"},
}
LOADING = re.compile(r"Loading weights took ([0-9.]+) seconds")


def make(path: Path, hidden: int = 2048, ffn: int = 5632, layers: int = 8, vocab: int = 32000) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=hidden // 512,
                         vocab_size=vocab, tie_word_embeddings=False, torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="250MB")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path}: {layers} layers, {size / 1e9:.2f} GB")


def make_quantized(path: Path, layout: str) -> None:
    """`make`'s Llama (float32 before quantizing) with its layers' linear weights in `layout`, as the test
    suite's quantized checkpoints are written (testbed/quantized_layouts.py), in 2 shards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from testbed import quantized_layouts

    sizes = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}  # fmt: skip
    path.mkdir(parents=True)
    made = quantized_layouts.make(path, sizes, [layout])[layout]
    size = sum(f.stat().st_size for f in made.glob("*.safetensors"))
    print(f"wrote {made}: {layout}, 8 layers, {size / 1e9:.2f} GB")


def one(fmt: str, model: str, tp: int, dtype: str, extra: dict[str, Any], reload: bool = False) -> None:
    """In a fresh process: engine up, one token out; with `reload`, then `reload_weights` of the same
    checkpoint twice, its pages cached (warm) and evicted (cold); prints the timings as JSON."""
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    # Every format timed alike: its loader's load_weights, whole (the engine runs in this process
    # for one tensor-parallel rank; with more, each format's own log line is all there is).
    timed: list[float] = []
    load_model = BaseModelLoader.load_model

    def load_model_timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        load_weights = self.load_weights

        def load_weights_timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return load_weights(*a, **k)
            finally:
                timed.append(time.perf_counter() - t)

        self.load_weights = load_weights_timed
        return load_model(self, *args, **kwargs)

    BaseModelLoader.load_model = load_model_timed  # type: ignore[method-assign]

    kwargs: dict[str, Any] = dict(FORMATS[fmt])
    if extra:
        kwargs["model_loader_extra_config"] = extra
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, max_model_len=512,
              seed=0, **kwargs)  # fmt: skip
    ready = time.perf_counter()
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    first = time.perf_counter()
    report: list[Any] = []
    if fmt == "streamload":
        report = llm.collective_rpc(_streamload_report)
    reloads: dict[str, float] = {}
    if reload:
        from streamload.commands.bench import evict

        for how in ("warm", "cold"):
            if how == "cold":
                evict([str(f) for f in Path(model).glob("*.safetensors")])
            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
            reloads[how] = time.perf_counter() - t
        if fmt == "streamload":
            report = llm.collective_rpc(_streamload_report)  # the last reload's
    print("RESULT " + json.dumps({"ready": ready - started, "first_token": first - started, "timed": timed,
                                  "token": out[0].outputs[0].token_ids[0], "report": report,
                                  "reload": reloads}), flush=True)  # fmt: skip


def _streamload_report(worker: Any) -> dict[str, Any]:
    import streamload.integrations.vllm

    return vars(streamload.integrations.vllm.last_load).copy()


def run(fmt: str, model: Path, tp: int, dtype: str, cold: bool, extra: str, reload: bool = False) -> dict[str, Any]:
    from streamload.commands.bench import evict, parallel_read

    files = [str(f) for f in model.glob("*.safetensors")]
    if cold:
        evict(files)
    else:  # fill the page cache: the run before may have read with O_DIRECT, or been a cold one
        parallel_read(files, direct=False, pinned=False)()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the run's process: its loader timed
    else:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    started = time.perf_counter()
    command = [sys.executable, __file__, "--one", fmt, str(model), "--tp", str(tp), "--dtype", dtype]
    if fmt == "streamload" and extra:
        command += ["--extra", extra]
    if reload:
        command += ["--reload"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    lines = done.stdout + done.stderr
    result = next((json.loads(line[7:]) for line in lines.splitlines() if line.startswith("RESULT ")), None)
    loading = (result or {}).get("timed") or [float(m) for m in LOADING.findall(lines)]
    if done.returncode or result is None or not loading:
        errors = [line for line in lines.splitlines() if "Error" in line and "Tokenizer not available" not in line]
        error = errors[-1] if errors else lines[-300:]
        return {"error": error.strip()[-300:], "wall": wall}
    return {**result, "loading": max(loading), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("--make", type=Path, help="write a bf16 Llama checkpoint here and exit")
    parser.add_argument("--quantized", help="with --make: the Llama's linear layers quantized in this layout "
                        "(testbed/quantized_layouts.py: w8a8-int8, fp8-channel, w4a8, gptq, ...)")  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (default: float32)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--extra", default="", help="streamload's model_loader_extra_config, as JSON")
    parser.add_argument("--reload", action="store_true", help="also time reload_weights, warm and cold")
    args = parser.parse_args()
    if args.make and args.quantized:
        return make_quantized(args.make, args.quantized)
    if args.make:
        return make(args.make)
    if args.one:
        return one(args.one, str(args.model), args.tp, args.dtype, json.loads(args.extra or "{}"), args.reload)
    if args.model is None:
        parser.error("give a model directory (make one with --make)")
    formats = args.formats.split(",")
    from streamload.commands.bench import compile_streamload

    compile_streamload()  # as installed: no run compiles our modules
    results: dict[str, dict[str, list[dict[str, Any]]]] = {m: {f: [] for f in formats} for m in args.modes.split(",")}
    for i in range(args.runs):
        for mode in results:
            for fmt in formats:
                if results[mode][fmt] and "error" in results[mode][fmt][0]:
                    continue  # a format that cannot run here fails alike every time
                r = run(fmt, args.model, args.tp, args.dtype, cold=mode == "cold", extra=args.extra, reload=args.reload)
                results[mode][fmt].append(r)
                shown = r.get("error") or f"loading {r['loading']:.2f} s, ready {r['ready']:.1f} s"
                print(f"run {i + 1} {mode:4} {fmt:15} {shown}", flush=True)
    summary = summarise(results)
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))


def summarise(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode, by_format in results.items():
        for fmt, runs in by_format.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                out[f"{mode}/{fmt}"] = {"error": runs[0]["error"] if runs else "not run"}
                continue
            row = {k: statistics.median(r[k] for r in ok) for k in ("loading", "ready", "first_token")}
            for how in ("warm", "cold"):
                if all(how in r.get("reload", {}) for r in ok):
                    row[f"reload_{how}"] = statistics.median(r["reload"][how] for r in ok)
            reports = [rank for r in ok for rank in r.get("report") or []]
            if reports:
                row["read_per_rank"] = max(rank["bytes_read"] for rank in reports) / reports[0]["bytes_total"]
            out[f"{mode}/{fmt}"] = {**row, "runs": len(ok)}
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| mode | format | weights loaded (s) | x default | engine ready (s) | first token (s) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for key, row in summary.items():
        mode, fmt = key.split("/")
        if "error" in row:
            lines.append(f"| {mode} | {fmt} | did not run: {row['error'][:120]} | | | |")
            continue
        base = summary.get(f"{mode}/safetensors", {}).get("loading")
        ratio = f"{row['loading'] / base:.2f}x" if base else ""
        lines.append(
            f"| {mode} | {fmt} | {row['loading']:.2f} | {ratio} | {row['ready']:.1f} | {row['first_token']:.1f} |"
        )
    reloads = [(key, row) for key, row in summary.items() if "reload_warm" in row]
    if reloads:
        lines += ["", "| engine started | format | reload, warm (s) | x default | reload, cold (s) | x default |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for key, row in reloads:
            mode, fmt = key.split("/")
            base = summary.get(f"{mode}/safetensors", {})
            w, c = row["reload_warm"], row["reload_cold"]
            wx = f"{w / base['reload_warm']:.2f}x" if "reload_warm" in base else ""
            cx = f"{c / base['reload_cold']:.2f}x" if "reload_cold" in base else ""
            lines.append(f"| {mode} | {fmt} | {w:.2f} | {wx} | {c:.2f} | {cx} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
