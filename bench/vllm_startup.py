"""A vLLM server's start-up with its weights behind a network: process start to first token.

One node (a network namespace, testbed/netsim.py) has the model's config locally and its weights on an
nginx store whose link is capped (`--storage-mbit`). Each case is a fresh process on the node, the
engine as a server runs it (its own engine-core and worker processes), timed from the process's
creation to its first token:

- `dummy`: vLLM with `load_format="dummy"`: the engine's own start-up, nothing read;
- `download`: `streamload.load(url)` alone, imports included;
- `streamload, prefetch off`: the loader reads when vLLM calls it (after the engine has started);
- `streamload`: the plugin alone: the weights start moving where vLLM builds its load config (ahead.py);
- `streamload, ahead`: the script's first line is `streamload.integrations.startup.prefetch.ahead(url)`, before vLLM's
  import (what `streamload serve -- vllm serve ...` does for a server); the format adopts that fetch;
- `streamload, overlap`: as `ahead`, with `"overlap": true`: vLLM profiles, compiles and warms up
  while the weights arrive; they are loaded in place after warm-up (integrations/vllm/startup/overlap.py).

`--in-process` runs the engine in the script's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

`--peers`: a second node (links `--node-mbit`, default 1000) runs an engine that loaded the weights
from the store into its `cache_dir` and seeds them (`{"seed": ...}`) while it serves; then, on the
first node, `streamload` (from the store) against `streamload, peers` (the same with `{"peers": [that
node], "cache_dir": ...}`): the second engine's start-up at the peer's rate, the store serving it ~nothing:

    python bench/vllm_startup.py /tmp/llama-300m --storage-mbit 200 --peers \\
        --cases dummy download streamload "streamload, peers"

(peers need the digest file beside the weights: written by `streamload digest` where absent)

`--compile-cache` (compiled, the fetch started first): a node whose compile cache is empty, without
and with the artifacts a warm node published beside the weights (`streamload compile-cache
publish`), against the warm node:

    python bench/vllm_startup.py /tmp/llama-300m --storage-mbit 200 --compile-cache --runs 2

Target: streamload <= 1.15x max(dummy, download). The streamload cases' first tokens are compared
with vLLM's own loader reading the same files locally. Needs root and nginx (testbed/netsim.py).

    python bench/vllm_startup.py --make /tmp/llama-300m            # a 0.3 GB bf16 Llama, 4 shards
    python bench/vllm_startup.py /tmp/llama-300m --storage-mbit 200 --runs 2
    python bench/vllm_startup.py /tmp/llama-300m --storage-mbit 200 --tp 2
    python bench/vllm_startup.py /tmp/llama-300m --storage-mbit 200 --compiled   # with vLLM's compilation
    python bench/vllm_startup.py /tmp/llama-300m --storage-mbit 80 --in-process --compiled \
        --cases dummy download "streamload, ahead" "streamload, overlap"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

CASES = ("dummy", "download", "streamload, prefetch off", "streamload", "streamload, ahead", "streamload, overlap")
PEER_CASES = ("streamload, peers",)
SEED_PORT = 8470
COMPILE_CASES = ("empty cache", "empty cache, published", "warm cache")


def since_start() -> float:
    """Seconds since this process was created (the kernel's clock of it, not the interpreter's)."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start


def one(case: str, model: str, url: str, tp: int, compiled: bool) -> None:
    if case in ("streamload, ahead", "streamload, overlap") or case in COMPILE_CASES:  # the script's first line
        from streamload.integrations.startup import prefetch

        prefetch.ahead(url, compile_cache=_pinned(case))
    if case == "download":
        import streamload

        n = sum(t.numel() for t in streamload.load(url, device="cpu").values())
        print("RESULT " + json.dumps({"first_token": since_start(), "elements": n}), flush=True)
        return
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {"load_format": "dummy" if case == "dummy" else "streamload"}
    if case == "local":
        kwargs["load_format"] = "safetensors"
    elif case.startswith("streamload"):
        kwargs["model_loader_extra_config"] = {"source": url, "prefetch": case != "streamload, prefetch off"}
        if case == "streamload, overlap":
            kwargs["model_loader_extra_config"]["overlap"] = True
        if case == "streamload, peers":
            kwargs["model_loader_extra_config"] |= {"cache_dir": os.environ["STREAMLOAD_BENCH_CACHE"],
                                                    "peers": os.environ["STREAMLOAD_BENCH_PEERS"]}  # fmt: skip
    elif case == "seeding":  # the node already serving: loaded from the store into its cache, seeding it
        kwargs["load_format"] = "streamload"
        kwargs["model_loader_extra_config"] = {"source": url, "cache_dir": os.environ["STREAMLOAD_BENCH_CACHE"],
                                               "seed": os.environ["STREAMLOAD_BENCH_SEED"]}  # fmt: skip
    elif case in COMPILE_CASES:
        kwargs["load_format"] = "streamload"
        kwargs["model_loader_extra_config"] = {"source": url, "compile_cache": _pinned(case)}
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=not compiled, dtype="bfloat16",
              max_model_len=256, seed=0, **kwargs)  # fmt: skip
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)  # fmt: skip
    first = since_start()
    print("RESULT " + json.dumps({"first_token": first, "tokens": list(out[0].outputs[0].token_ids)}), flush=True)
    if case == "seeding":
        time.sleep(900)  # serving (and seeding) until the bench ends it


def _pinned(case: str) -> str | None:
    """The published archive's digest, for the cases that install it (the runs are told it by `main`)."""
    return os.environ.get("STREAMLOAD_BENCH_PIN") if case in COMPILE_CASES and case != "empty cache" else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("--make", type=Path, help="write a 0.3 GB bf16 Llama checkpoint here and exit")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--storage-mbit", type=float, default=200)
    parser.add_argument("--first-byte-ms", type=float, default=30)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="without enforce_eager: vLLM compiles")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--in-process", action="store_true", help="the engine in the script's process")
    parser.add_argument("--cases", nargs="+", default=None, choices=CASES + COMPILE_CASES + PEER_CASES)
    parser.add_argument("--peers", action="store_true", help="a second node serves and seeds (see above)")
    parser.add_argument("--node-mbit", type=float, default=1000, help="the nodes' links, with --peers")
    parser.add_argument("--logs", type=Path, help="keep each run's output here (<run>-<case>.log)")
    parser.add_argument("--compile-cache", action="store_true", help="cold compile caches, with and without "
                        "the artifacts published beside the weights (implies --compiled)")  # fmt: skip
    args = parser.parse_args()
    if args.compile_cache:
        args.compiled = True
    args.cases = args.cases or list(COMPILE_CASES if args.compile_cache else CASES)
    if args.one:
        return one(args.one[0], args.one[1], args.one[2], args.tp, args.compiled)
    if args.make:
        from bench.vllm import make

        return make(args.make, hidden=1024, ffn=2816, layers=8, vocab=32000)
    if args.model is None:
        parser.error("give a model directory (make one with --make)")
    from testbed.netsim import Net

    if why := Net.missing():
        sys.exit(f"cannot simulate a network here: {why}")
    model = args.model.resolve()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    if args.in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
    flags = ["--tp", str(args.tp)] + (["--compiled"] if args.compiled else [])
    caches = Path(tempfile.mkdtemp(prefix="vllm-startup-caches-"))
    if args.compile_cache:  # the warm node compiles once and publishes; every other run starts empty
        env["VLLM_CACHE_ROOT"] = str(caches / "warm")
    local = _run(["--one", "local", str(model), ""], flags, env, None)
    if args.compile_cache:
        from streamload.integrations.startup import pinned_digests as pins
        from streamload.integrations.vllm.startup import compiled

        archive = compiled.publish(model, caches / "warm")
        env["STREAMLOAD_BENCH_PIN"] = pins.digest(archive.read_bytes())  # the runs trust this archive only
        print(f"published {archive} ({env['STREAMLOAD_BENCH_PIN']})", flush=True)
    results: dict[str, list[dict[str, Any]]] = {case: [] for case in args.cases}
    nodes = 2 if args.peers else 1
    node_mbit = args.node_mbit if args.peers else None
    with Net(model, nodes=nodes, storage_mbit=args.storage_mbit, first_byte_ms=args.first_byte_ms,
             node_mbit=node_mbit) as net:  # fmt: skip
        if args.peers:
            if not (model / "streamload.digests.json").exists():
                subprocess.run([sys.executable, "-m", "streamload", "digest", str(model)], check=True, env=env)
            seeding, seeder = _seeding(net, model, flags, env, caches)
            env = {**env, "STREAMLOAD_BENCH_PEERS": f"http://{net.node_ips[1]}:{SEED_PORT}"}
            print(f"node 1 serves and seeds: up {seeding:.1f} s after its start", flush=True)
        for i in range(args.runs):
            for case in args.cases:
                root = (
                    caches / "warm"
                    if case in ("warm cache",)
                    else caches / f"empty-{i}-{COMPILE_CASES.index(case) if case in COMPILE_CASES else 0}"
                )  # no spaces: compilers take the path
                cache = {"VLLM_CACHE_ROOT": str(root)} if args.compile_cache else {}
                if case in PEER_CASES:  # a cache of its own each run: what a new node has
                    cache["STREAMLOAD_BENCH_CACHE"] = str(caches / f"joiner-{i}")
                before = net.served()
                done = _run(["--one", case, str(model), net.url], flags, {**net.env(), **env, **cache}, net)
                done["served"] = net.served() - before  # bytes the store sent this run
                results[case].append(done)
                if args.logs:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    (args.logs / f"{i + 1}-{case.replace(', ', '-').replace(' ', '-')}.log").write_text(done["output"])
                shown = done.get("error") or f"{done['first_token']:.1f} s"
                print(f"run {i + 1} {case:25} {shown}", flush=True)
        if args.peers:  # a Ctrl-C, not the network's SIGTERM: its exit handlers remove what its fetch staged
            seeder.send_signal(signal.SIGINT)
            seeder.wait(60)
    shutil.rmtree(caches, ignore_errors=True)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    how = ("compiled" if args.compiled else "eager") + (", in-process" if args.in_process else "")
    print(f"\n{size / 1e9:.2f} GB at {args.storage_mbit:g} Mbit/s (first byte {args.first_byte_ms:g} ms), "
          f"TP={args.tp}, {how}, median of {args.runs}; process start to first token:")  # fmt: skip
    median = {
        c: statistics.median(r["first_token"] for r in rs)
        for c, rs in results.items()
        if all("error" not in r for r in rs)
    }
    bound = median.get("warm cache") or max(median.get("dummy", 0.0), median.get("download", 0.0))
    against = "x the warm cache" if args.compile_cache else "x max(dummy, download)"
    print(
        f"| case | first token (s) | {against} | tokens as vLLM's loader's | the store served |\n|---|---|---|---|---|"
    )
    for case, runs in results.items():
        if case not in median:
            print(f"| {case} | did not run: {runs[0].get('error', '')[:100]} | | | |")
            continue
        same = "" if case in ("dummy", "download") else str(all(r["tokens"] == local.get("tokens") for r in runs))
        served = statistics.median(r["served"] for r in runs) / size
        print(f"| {case} | {median[case]:.1f} | {median[case] / bound:.2f}x | {same} | {served:.1%} |")


def _seeding(
    net: Any, model: Path, flags: list[str], env: dict[str, str], caches: Path
) -> tuple[float, subprocess.Popen[str]]:
    """Node 1's engine, loaded from the store into its cache and seeding it, serving until the bench ends;
    the seconds it took to its first token, and its process."""
    cache = {
        "STREAMLOAD_BENCH_CACHE": str(caches / "seeder"),
        "STREAMLOAD_BENCH_SEED": f"{net.node_ips[1]}:{SEED_PORT}",
    }
    command = [sys.executable, __file__, "--one", "seeding", str(model), net.url, *flags]
    proc = net.start(1, command, env={**net.env(), **env, **cache}, cwd=ROOT, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 600
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # its log, drained
            time.sleep(2)  # its seeder starts once the load is complete
            return float(json.loads(line[7:])["first_token"]), proc
        if time.monotonic() > deadline:
            break
    raise RuntimeError("the seeding engine did not come up")


def _run(argv: list[str], flags: list[str], env: dict[str, str], net: Any) -> dict[str, Any]:
    command = [sys.executable, __file__, *argv, *flags]
    try:
        if net is None:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        else:
            done = net.run_on("n0", command, timeout=600, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s", "output": ""}
    lines = done.stdout + done.stderr
    result = next((json.loads(line[7:]) for line in lines.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        errors = [line for line in lines.splitlines() if "Error" in line and "Tokenizer" not in line]
        return {"error": (errors[-1] if errors else lines[-300:]).strip()[-300:], "output": lines}
    time.sleep(1)  # the engine's processes, killed with it, let go of the cores
    return {**result, "output": lines}


if __name__ == "__main__":
    main()
