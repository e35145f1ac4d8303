"""Real vLLM engines on this machine's CPU, for the scenarios of the feature test modules (`FEATURES`): each
scenario lives beside the tests that read what it records, and is run here, in a child process of the
suite, with the others of its part, so that they share vLLM's imports; the results are written as JSON.
Run as `python -m tests.vllm_engines OUT.json --PART` (one part, as the suite runs them side by side:
`--engines`, `--quantized`, `--fresh`; `--compiled-tp2`, the slow one, with STREAMLOAD_SLOW=1), or without a
part for all but the slow one, in turn.

A scenario builds real checkpoints with transformers' `save_pretrained`, starts engines with
`load_format="streamload"` and with vLLM's own `"safetensors"` loader, and records greedy tokens,
parameter addresses and what streamload read (`engine`, `tokens`, `state`, `close`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import streamload
from tests import vllm_reference_kernels
from tests.conftest import in_environment

SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 42, 250, 3, 9]]
# Each engine's KV cache: the models are tiny and 256 tokens long. (VLLM_CPU_KVCACHE_SPACE, a GiB at
# least, would be zeroed for every engine: ~1 s of CPU each here.)
KV_CACHE = {"kv_cache_memory_bytes": 64 << 20}

# The modules whose scenarios the parts run. A part runs its scenarios in the order of their modules here,
# and of their definitions in each: its engines share this process, and some rely on what ran before them
# (an in-process engine that fails to start leaves vLLM's parallel state to the next one: a mixture of
# experts cannot start on a dense model's).
FEATURES = ("test_vllm", "test_vllm_overlap", "test_vllm_reload", "test_vllm_peers", "test_vllm_plugin",
            "test_vllm_check", "test_vllm_tensor_parallel", "test_vllm_quantized")  # fmt: skip
Scenario = Callable[[Path, "Timed"], Any]  # (the part's folder, its results): records keys into the results
SCENARIOS: dict[str, list[Scenario]] = {}  # by part, in the order they run


def scenario(part: str) -> Callable[[Scenario], Scenario]:
    """Registers a feature module's function as a scenario of `part` ("engines", "quantized", "fresh",
    "compiled-tp2"). One that yields is started in its turn and ended after the part's other scenarios:
    its start-up (a server's) overlaps theirs."""

    def register(run: Scenario) -> Scenario:
        SCENARIOS.setdefault(part, []).append(run)
        return run

    return register


def run_part(part: str, root: Path, out: Timed) -> None:
    """`part`'s scenarios in turn (those that yield ended last, in reverse), their results in `out`."""
    started = []
    try:
        for run in SCENARIOS[part]:
            begun = run(root, out)
            if inspect.isgenerator(begun):
                next(begun)
                started.append(begun)
        for begun in reversed(started):
            next(begun, None)
    finally:
        for begun in started:
            begun.close()


# One engine's failure is its tests' alone: a scenario that raises records its error under the keys it was
# to record (written beside the results, "errors"), closes the engines it left open, and the run goes on.
ERRORS: dict[str, str] = {}
OPEN: list[Any] = []  # engines built and not yet closed
RECORDING: list[str] = []  # the keys of the scenario running now
# Engines broken on purpose (keys, comma-separated; a part's flag, "--fresh", ends that part at once): to see
# the tests of the other engines pass, and those of a broken one fail with its error.
BREAK = "STREAMLOAD_TEST_BREAK_ENGINE"


@contextlib.contextmanager
def recording(out: dict[str, Any], *keys: str) -> Iterator[None]:
    """The scenario that records `keys` in `out`: where it raises, each of them it did not record gets the
    error (a key's scenario also stands for the keys below it: "x" for "x/reloaded")."""
    opened = len(OPEN)
    RECORDING[:] = keys
    try:
        yield
    except Exception:
        error = traceback.format_exc()
        print(f"recording {', '.join(keys)} failed:\n{error}", file=sys.stderr, flush=True)
        for key in keys:
            if key not in out:
                ERRORS.setdefault(key, error)
        for llm in OPEN[opened:]:
            with contextlib.suppress(Exception):
                close(llm)
    finally:
        RECORDING.clear()


def raise_if_broken() -> None:
    """Raises where this scenario's engine is to break (`BREAK`)."""
    asked = set(os.environ.get(BREAK, "").split(",")) & set(RECORDING)
    if asked:
        raise RuntimeError(f"{BREAK}={os.environ[BREAK]}: the engine recording {sorted(asked)[0]!r} broken on purpose")


def make_models(root: Path) -> dict[str, Path]:
    import transformers

    configs: dict[str, Callable[[], Any]] = {
        # A vocabulary of 8192: the head is 4 MiB, 4 blocks of a digest, 2 per tensor-parallel rank (a
        # damaged byte in one rank's rows fails that rank alone).
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**{**SMALL, "vocab_size": 8192}, tie_word_embeddings=False)
        ),
        "qwen2-tied": lambda: transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)
        ),
        "qwen2-moe": lambda: transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                **{**SMALL, "intermediate_size": 128},
                moe_intermediate_size=64,
                shared_expert_intermediate_size=128,
                num_experts=4,
                num_experts_per_tok=2,
                tie_word_embeddings=False,
            )
        ),
    }
    paths = {}
    for seed, (name, build) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = build()
        with torch.no_grad():  # weights large enough that greedy tokens depend on every one of them
            for p in model.parameters():
                p.normal_(0, 0.2)
        paths[name] = root / name
        model.save_pretrained(paths[name], max_shard_size="200KB")  # several shards and an index
        if name == "llama":  # the same model with other weights, for the in-place reload
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.5)
            paths["llama-new"] = root / "llama-new"
            model.save_pretrained(paths["llama-new"], max_shard_size="200KB")
    from streamload.pipeline.verify import write_digests

    for path in paths.values():  # `streamload digest`: what verify=True checks against
        write_digests(streamload.inspect(path))
    return paths


# `make_models` in a part's folder, made by the first of its scenarios that asks
models = functools.cache(make_models)


def engine_processes() -> set[int]:
    """This process's descendants that vLLM made (named VLLM::...), not those of the OpenAI server."""
    import psutil

    me = psutil.Process()
    server = {c.pid for c in me.children() if "api_server" in " ".join(c.cmdline())}
    mine = set()
    for child in me.children(recursive=True):
        try:
            if child.name().startswith("VLLM") and not ({p.pid for p in child.parents()} & server):
                mine.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return mine


def fetching_processes(source: str) -> list[int]:
    """Processes still fetching `source` ahead of a load (`streamload.integrations.startup.prefetch`: detached, not
    children)."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            argv = process.cmdline()
        except psutil.Error:
            continue
        if any("streamload.integrations.startup.prefetch" in a for a in argv) and source in argv:
            found.append(process.pid)
    return found


def mla_backend(path: Path) -> dict[str, str]:
    """vLLM's attention for an MLA model (DeepSeek's), the same on every CPU: where the CPU has AMX tiles
    vLLM picks its AMX kernel, which runs only DeepSeek's own sizes (head size 576) in bfloat16, and the
    tests' small float32 model failed there ("invalid weight input features 16"); its reference CPU MLA
    runs everywhere."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"attention_backend": "CPU_MLA"} if "kv_lora_rank" in config else {}


class ForkedWorkers:
    """A `spawn` context whose processes are forked from multiprocessing's forkserver, which imported
    vLLM's CPU worker once, each run in the environment its parent has when it starts it (as `spawn`'s
    children are; a forkserver's would otherwise keep the server's)."""

    def __init__(self) -> None:
        import multiprocessing

        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["tests.vllm_engines", "vllm.v1.worker.cpu_worker"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def get_start_method(self) -> str:
        return "spawn"  # what vLLM asked for: it keeps no inherited descriptors to close (those are fork's)

    def Process(self, *, target: Callable[..., Any], args: tuple[Any, ...] = (), **rest: Any) -> Any:
        return self._context.Process(target=_worker, args=(dict(os.environ), target, *args), **rest)


def _worker(environment: dict[str, str], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    collect_what_engines_make()
    vllm_reference_kernels.install()
    return in_environment(environment, target, *args, **kwargs)


def collect_what_engines_make() -> None:
    """vLLM collects the whole heap ~8 times an engine, at start and at shutdown: ~0.5 s each here (torch's
    and vLLM's modules are ~650,000 objects), ~4.5 s of the ~6 s an in-process engine took.
    The harness freezes what its imports made, once, and keeps vLLM's own freeze/unfreeze from moving
    it back: vLLM's collections then scan what its engines made (every engine's garbage is still
    collected; what a module holds never was garbage)."""
    gc.freeze()
    gc.freeze = gc.unfreeze = lambda: None


def workers_from_a_forkserver() -> None:
    """vLLM's CPU platform starts tensor-parallel workers with `spawn`: each imports vLLM afresh, ~18 s
    of CPU here, twice per TP=2 engine. The harness forks them from a process that imported it once;
    what they run (vLLM's worker, its plugin loading, streamload's loader) is unchanged."""
    from vllm.v1.executor import multiproc_executor

    workers = ForkedWorkers()
    multiproc_executor.get_mp_context = lambda: workers


def engine(path: Path, load_format: str, **kwargs: Any) -> Any:
    from vllm import LLM

    kwargs = {
        "enforce_eager": True,
        "dtype": "float32",
        **KV_CACHE,
        **mla_backend(path),
        **{k: v for k, v in kwargs.items() if v is not None},
    }
    raise_if_broken()
    llm = LLM(model=str(path), load_format=load_format, skip_tokenizer_init=True, max_model_len=256, seed=0, **kwargs)
    OPEN.append(llm)
    return llm


def tokens(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _model_state(worker: Any) -> dict[str, Any]:
    """On a worker: each parameter's address and a digest of its bytes; what streamload read."""
    import hashlib

    import streamload.integrations.vllm

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()

    model = worker.model_runner.get_model()
    params = {n: (p.data_ptr(), digest(p)) for n, p in model.named_parameters()}
    # What the CPU's linear layers compute with lives outside their parameters (a packed copy held by
    # `cpu_linear`, the weight parameter emptied): each one's output on a fixed input stands for it.
    kernels = {}
    with torch.no_grad():
        for n, m in model.named_modules():
            k = getattr(m, "input_size_per_partition", getattr(m, "input_size", None))
            if callable(getattr(m, "cpu_linear", None)) and isinstance(k, int):
                x = torch.linspace(-1, 1, 3 * k, dtype=worker.model_config.dtype).reshape(3, k)
                kernels[n] = digest(m.cpu_linear(x, m.weight, getattr(m, "bias", None)))
    hooked = "compile_or_warm_up_model" in vars(getattr(worker, "worker", worker))
    return {"params": params, "kernels": kernels, "hooked": hooked,
            "report": vars(streamload.integrations.vllm.last_load).copy()}  # fmt: skip


def state(llm: Any) -> list[dict[str, Any]]:
    return llm.collective_rpc(_model_state)


def close(llm: Any) -> None:
    import gc

    if any(llm is o for o in OPEN):
        OPEN.remove(llm)
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm
    gc.collect()


def error_of(call: Callable[[], Any]) -> str:
    try:
        llm = call()
    except Exception as exc:  # the engine's own error, as a user would see it
        return "".join(traceback.format_exception_only(type(exc), exc)) + repr(exc.__cause__)
    close(llm)
    return ""


def check_result(report: Any) -> dict[str, Any]:
    """What `streamload.integrations.vllm.check` reported, as the tests read it."""
    return {"ok": report.ok, "differences": report.differences, "tensors": report.tensors, "report": report.streamload}


class Timed(dict[str, Any]):
    """Results that note how long each took to get (seconds since the previous one): where CI time goes."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __setitem__(self, key: str, value: Any) -> None:
        now = time.perf_counter()
        self.seconds[key] = round(now - self._last, 2)
        self._last = now
        super().__setitem__(key, value)


ENGINES_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engines in this process: ~4 s each, not ~35 s
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with our own functions
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # a core per tensor-parallel rank
}
SUITE_ENVIRONMENT: dict[str, str] = {}  # the suite's, for the processes of their own (the "fresh" part)


def main() -> None:
    started = time.perf_counter()
    SUITE_ENVIRONMENT.update(os.environ)
    if "--quantized" in sys.argv:  # its one-rank engines on the other core than the engines' (same time)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1|0")
    for name, value in ENGINES_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if set(os.environ.get(BREAK, "").split(",")) & set(sys.argv[2:]):  # a part that dies (see BREAK)
        raise SystemExit(f"{BREAK}={os.environ[BREAK]}: this part ({' '.join(sys.argv[2:])}) ended on purpose")
    workers_from_a_forkserver()
    vllm_reference_kernels.install()  # FP8 with block scales only: no kernel on this CPU (ranks: `_worker`)
    import vllm.entrypoints.llm  # noqa: F401  (imported before the freeze)

    for module in FEATURES:  # their scenarios registered (what they import at their top is cheap)
        importlib.import_module(f"tests.{module}")
    gc.collect()
    collect_what_engines_make()
    # the suite starts the three parts together (conftest.py); run alone, this takes them in turn
    parts = [flag.removeprefix("--") for flag in sys.argv[2:]] or ["engines", "fresh", "quantized"]
    results = Timed()
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            run_part(part, Path(tmp), results)
    seconds = results.seconds | {"all": round(time.perf_counter() - started, 2)}
    # the keys whose engine raised: their tests fail with it (tests/conftest.py)
    Path(sys.argv[1]).write_text(json.dumps({**results, "seconds": seconds, "errors": ERRORS}))


if __name__ == "__main__":
    # Run as `python -m`, this module is `__main__`: the feature modules register their scenarios in (and
    # record with) `tests.vllm_engines`, imported here under its own name.
    from tests import vllm_engines

    vllm_engines.main()
