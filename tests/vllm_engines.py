"""Real vLLM engines on this machine's CPU, in one process so they share vLLM's imports: every scenario
that `test_vllm.py` checks, its results written as JSON. Run as `python -m tests.vllm_engines OUT.json`
(`--engines` or `--fresh`: one part, as the suite runs them side by side; `--compiled-tp2`: the slow
scenario only, run by the test suite with STREAMLOAD_SLOW=1).

Each scenario builds real checkpoints with transformers' `save_pretrained`, starts engines with
`load_format="streamload"` and with vLLM's own `"safetensors"` loader, and records greedy tokens,
parameter addresses and what streamload read.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import streamload
import streamload.commands.publish
from testbed import quantized_layouts
from tests import vllm_reference_kernels
from tests.conftest import in_environment

SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 42, 250, 3, 9]]
# Each engine's KV cache: the models are tiny and 256 tokens long. (VLLM_CPU_KVCACHE_SPACE, a GiB at
# least, would be zeroed for every engine: ~1 s of CPU each here.)
KV_CACHE = {"kv_cache_memory_bytes": 64 << 20}

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


def _broken() -> None:
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


def many_experts(root: Path, layers: int = 12) -> Path:
    """Qwen3-30B-A3B's checkpoint layout (128 experts a layer, the hub's names) in 12 of its 48 layers:
    4,719 tensors, as `bench/moe.py` writes it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe", Path(__file__).parent.parent / "bench" / "moe.py")
    assert spec is not None and spec.loader is not None
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    moe.make(root / f"qwen3-moe-{layers}", "qwen3-moe", layers=layers)
    return root / f"qwen3-moe-{layers}"


def failed_reloads(llm: Any, root: Path, paths: dict[str, Path]) -> dict[str, Any]:
    """Reloads that fail mid-way (after earlier layers took new weights) or before anything arrived,
    on an engine serving llama-new: each must leave every rank serving llama-new at the same
    addresses; the engine's processes must end with it."""
    import shutil

    new = paths["llama-new"]

    def copy(name: str) -> Path:
        target = root / name
        shutil.copytree(new, target)
        return target

    flipped = copy("llama-new-flipped")  # with llama-new's digest file, a byte of rank 0's rows of the head flipped
    head = streamload.inspect(flipped).tensors["lm_head.weight"]
    with open(head.path, "r+b") as f:
        f.seek(head.begin + 100)
        byte = f.read(1)
        f.seek(head.begin + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    truncated = copy("llama-new-truncated")  # the last shard cut short
    last = sorted(truncated.glob("*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size // 2)
    missing = copy("llama-new-missing")  # a shard the index names is gone
    sorted(missing.glob("*.safetensors"))[1].unlink()
    from tests.servers import RangeServer

    out: dict[str, Any] = {}
    server = RangeServer(root)  # llama-new over HTTP from a store that stops serving mid-reload
    try:
        cases = {"flipped": str(flipped), "truncated": str(truncated), "missing": str(missing),
                 "refused": f"{server.url}/llama-new/"}  # fmt: skip
        os.environ["STREAMLOAD_RETRIES"] = "1"
        for label, where in cases.items():
            server.faults = ["503"] * 10_000 if label == "refused" else []
            error = ""
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": where})
            except Exception as exc:  # the error the caller sees
                error = str(exc)
            server.faults = []
            out[label] = {"error": error, "tokens": tokens(llm), "state": state(llm)}
        out["requests"] = server.data_requests()
    finally:
        os.environ.pop("STREAMLOAD_RETRIES", None)
        server.close()
    return out


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


def make_checked_models(root: Path) -> dict[str, Path]:
    """Models whose every parameter `streamload.integrations.vllm.check` compares with vLLM's own loader: the two that
    were silently wrong (BGE-M3's .pt secondary heads, an untied BERT masked-LM decoder vLLM ties when it
    is not among the names its loader gets), an MLA + MoE model, fused checkpoint tensors, Conv1D, Gemma-2's
    norms and tied embeddings, gpt-oss's fused experts with biases and sinks."""
    import transformers

    def bge_m3() -> Any:
        config = transformers.XLMRobertaConfig(**{**SMALL, "max_position_embeddings": 260}, pad_token_id=1)
        return transformers.XLMRobertaModel(config, add_pooling_layer=False)

    deepseek = transformers.DeepseekV2Config(**{**SMALL, "intermediate_size": 128}, q_lora_rank=64, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        tie_word_embeddings=False)  # fmt: skip
    gpt_oss = transformers.GptOssConfig(**{**SMALL, "intermediate_size": 128}, num_local_experts=4,
        num_experts_per_tok=2, head_dim=32, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    builds: dict[str, Callable[[], Any]] = {
        "bert-mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**SMALL, tie_word_embeddings=False)),
        "bge-m3": bge_m3,
        "deepseek-v2": lambda: transformers.DeepseekV2ForCausalLM(deepseek),
        "phi3": lambda: transformers.Phi3ForCausalLM(
            transformers.Phi3Config(**SMALL, tie_word_embeddings=False, pad_token_id=0)
        ),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=300, n_positions=256)
        ),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=32)),
        "gpt-oss": lambda: transformers.GptOssForCausalLM(gpt_oss),
    }
    paths = {}
    for seed, (name, build) in enumerate(builds.items(), start=10):
        torch.manual_seed(seed)
        model = build()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        paths[name] = root / name
        model.save_pretrained(paths[name], max_shard_size="300KB")
    bge = paths["bge-m3"]  # vLLM's BgeM3EmbeddingModel: its sparse and colbert heads in .pt files beside
    config = json.loads((bge / "config.json").read_text())
    config.update(architectures=["BgeM3EmbeddingModel"], position_embedding_type="absolute")
    (bge / "config.json").write_text(json.dumps(config))
    torch.save({"weight": torch.randn(1, 128), "bias": torch.randn(1)}, bge / "sparse_linear.pt")
    torch.save({"weight": torch.randn(128, 128) * 0.1, "bias": torch.randn(128)}, bge / "colbert_linear.pt")
    _word_tokenizer().save_pretrained(bge)  # its pooling tasks need one
    return paths


def _word_tokenizer() -> Any:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(4, 300)} | {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "<s>",
                "sep_token": "</s>", "mask_token": "<unk>"}  # fmt: skip
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)


def checked(path: Path, tp: int = 1, **engine: Any) -> dict[str, Any]:
    from streamload.integrations.vllm.check import check

    _broken()
    return _checked(check(str(path), tp=tp, **{"dtype": "float32", **KV_CACHE, **mla_backend(path), **engine}))


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


def command(argv: list[str]) -> dict[str, Any]:
    """`streamload ARGV` in this process: its exit status and what it printed."""
    import contextlib
    import io

    from streamload.commands.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(argv)
    return {"status": status, "printed": printed.getvalue()}


class _ForkedWorkers:
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

    workers = _ForkedWorkers()
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
    _broken()
    llm = LLM(model=str(path), load_format=load_format, skip_tokenizer_init=True, max_model_len=256, seed=0, **kwargs)
    OPEN.append(llm)
    return llm


def _compiled_folder(llm: Any) -> str:
    """The folder vLLM's worker compiled into (`local_cache_dir`), under its compile cache."""
    folder = llm.collective_rpc(lambda self: self.vllm_config.compilation_config.local_cache_dir)[0]
    return str(folder)


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


TRAINER = """
import sys, torch, streamload.commands.publish
from safetensors.torch import load_file
from pathlib import Path
root, steps = Path(sys.argv[1]), sys.argv[2:]
for k, source in enumerate(steps, 1):  # step k: the weights of the model at `source`, in small shards
    tensors = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    streamload.commands.publish.publish(tensors, root, k, shard_bytes=300_000)
"""


def weight_sync(root: Path, paths: dict[str, Path]) -> dict[str, Any]:
    """vLLM's weight-sync life-cycle on the "streamload" engine: a trainer process publishes steps, the
    engine updates to each; then an update to a corrupt step and to one cut short mid-read."""
    import subprocess

    run_dir = root / "run"
    trainer = [sys.executable, "-c", TRAINER, str(run_dir), str(paths["llama-new"]), str(paths["llama"])]
    subprocess.run([*trainer, str(paths["llama-new"]), str(paths["llama-new"])], check=True)  # steps 1-4
    out: dict[str, Any] = {}
    llm = engine(paths["llama"], "streamload", weight_transfer_config={"backend": "streamload"})
    out["start"] = {"tokens": tokens(llm), "state": state(llm)}
    llm.init_weight_transfer_engine({"init_info": {"options": {"threads": 4}}})

    def update(step: int, **info: Any) -> str:
        llm.start_weight_update()
        error = ""
        try:
            llm.update_weights({"update_info": {"path": str(run_dir / f"step-{step}"), **info}})
            llm.finish_weight_update(f"step-{step}")
        except Exception as exc:  # the engine's error, as the trainer sees it (the session ends with it)
            error = str(exc)
        llm.reset_prefix_cache()
        return error

    for step in (1, 2):
        error = update(step, verify=True)
        out[f"step-{step}"] = {"error": error, "tokens": tokens(llm), "state": state(llm)}
    corrupt = sorted((run_dir / "step-3").glob("*.safetensors"))[-1]
    with open(corrupt, "r+b") as f:  # a flipped byte in the last shard's last tensor
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0x40]))
    last = max(streamload.inspect(corrupt).tensors.values(), key=lambda t: t.end).name  # the flipped byte's
    out["step-3"] = {"error": update(3, verify=True), "tokens": tokens(llm), "state": state(llm), "file": corrupt.name,
                     "tensor": last}  # fmt: skip
    from tests.servers import RangeServer

    server = RangeServer(run_dir)  # step 4 over HTTP, from a store that stops serving it mid-update
    server.faults = ["503"] * 10_000  # every data request past a file's first 256 KiB (headers are served)
    os.environ["STREAMLOAD_RETRIES"] = "1"
    try:
        llm.start_weight_update()
        error = ""
        try:
            llm.update_weights({"update_info": {"path": f"{server.url}/step-4/"}})
            llm.finish_weight_update("step-4")
        except Exception as exc:
            error = str(exc)
        llm.reset_prefix_cache()
        served = server.data_requests()
    finally:
        del os.environ["STREAMLOAD_RETRIES"]
        server.close()
    out["step-4"] = {"error": error, "tokens": tokens(llm), "state": state(llm), "served": served}
    close(llm)
    return out


class Server:
    """The vLLM CPU server recipe of docs/vllm.md, as written: vLLM's OpenAI server module with
    `--load-format streamload`, on 127.0.0.1, in its own process group (it starts an engine process)."""

    def __init__(self, model: Path, log: Path) -> None:
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = str(model)
        # only what docs/vllm.md sets (and the suite's own cache roots: tests/conftest.py's suite_environment)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") or k in SUITE_ROOTS}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--load-format", "streamload", "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", "256", "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                "--seed", "0", "--model-loader-extra-config", '{"ring_bytes": "1MiB"}']  # fmt: skip
        self.log = log
        self._sink = log.open("w")
        self.process = subprocess.Popen(argv, env=env, stdout=self._sink, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip

    def _get(self, path: str) -> int:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return r.status

    def wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if self._get("/health") == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready in {seconds} s:\n{self.log.read_text()[-4000:]}")

    def complete(self, prompt: list[int]) -> list[int]:
        """One completion, as the README's curl asks for it (plus the token ids in the answer)."""
        import urllib.request

        body = {"model": self.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == len(answer["choices"][0]["token_ids"])
        return list(answer["choices"][0]["token_ids"])

    def stop(self) -> int | None:
        """SIGINT (the server's own shutdown), then SIGKILL to the group if it lingers; the exit status."""
        import signal
        import subprocess

        try:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                return self.process.wait(60)
            except subprocess.TimeoutExpired:
                return None
        except ProcessLookupError:
            return self.process.returncode
        finally:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group is left
            except ProcessLookupError:
                pass
            self.process.wait()
            self._sink.close()


SUITE_ROOTS = ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_NO_USAGE_STATS")


def served(server: Server) -> dict[str, Any]:
    try:
        server.wait_ready(600)
        answers = [server.complete(p) for p in PROMPTS]
    except Exception:
        return {"error": traceback.format_exc(), "exit": server.stop()}
    return {"tokens": answers, "exit": server.stop(), "log": server.log.read_text()[-20000:]}


def run(root: Path) -> dict[str, Any]:
    paths = make_models(root)
    out: dict[str, Any] = {}
    # Started first so that its start-up (imports, an engine process) overlaps the in-process engines.
    server = Server(paths["llama"], root / "server.log")
    try:
        results = in_process(root, paths)
        out.update(results, seconds=results.seconds)
        started = time.perf_counter()
        out["server"] = served(server)
        out["seconds"]["server (after the rest)"] = round(time.perf_counter() - started, 2)
    finally:
        server.stop()
    return out


def fresh_processes(root: Path) -> dict[str, Any]:
    """vLLM in processes of their own (test_vllm_plugin.py's scripts, test_vllm_check.py's vllm-check on
    a bare CPU): run here, beside the suite, rather than on its critical path."""
    from tests import test_vllm_check, test_vllm_plugin

    out: dict[str, Any] = {}
    for name, script in test_vllm_plugin.SCRIPTS.items():
        with recording(out, name):
            out[name] = test_vllm_plugin.run_script(script, root / name, SUITE_ENVIRONMENT)
    bare = root / "vllm-check-bare"
    bare.mkdir()
    key = "vllm-check/without-cpu-variables"
    with recording(out, key):
        out[key] = test_vllm_check.vllm_check_without_cpu_variables(bare, SUITE_ENVIRONMENT)
    return out


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


def http_ahead(root: Path, paths: dict[str, Path], out: dict[str, Any]) -> None:
    """Weights over HTTP (ranged GETs), configs from the local directory."""
    from tests.servers import RangeServer

    server = RangeServer(root)
    try:
        # Fetched from before the engine was built (prefetch.ahead; adopted by the format), each file
        # read by the loader as soon as it is complete.
        from streamload.integrations.startup import prefetch

        started = prefetch.ahead(f"{server.url}/llama/")
        llm = engine(paths["llama"], "streamload", model_loader_extra_config={"source": f"{server.url}/llama/"})
        run = {"tokens": tokens(llm), "state": state(llm), "data_requests": server.data_requests(),
               "sent": server.sent, "ahead": started, "env_left": prefetch.ENV in os.environ,
               "checkpoint": sum(f.stat().st_size for f in paths["llama"].glob("*.safetensors"))}  # fmt: skip
        staged = run["state"][0]["report"]["staged"]
        run["staged_left"] = bool(staged) and Path(staged).exists()
        close(llm)
        run["fetching"] = fetching_processes(f"{server.url}/llama/")
        out["llama/streamload-http-ahead"] = run
    finally:
        server.close()


def _answers(url: str) -> bool:
    """Whether anything accepts connections at `url` (http://HOST:PORT)."""
    import socket

    host, port = url.split("://")[1].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def from_peers(root: Path, paths: dict[str, Path], out: dict[str, Any]) -> None:
    """A node that starts while another serves and seeds (docs/peers.md): engine 1 loads llama from an HTTP
    store (in one file, its digest file published beside it) into cache_dir node-1 and seeds it ("seed");
    engine 2, started while engine 1 serves, loads with cache_dir node-2 and peers=[engine 1's seeder]."""
    from safetensors.torch import load_file, save_file

    from streamload.integrations.startup import prefetch
    from streamload.pipeline.verify import write_digests
    from tests.servers import RangeServer

    one = root / "store" / "llama"  # one file: the store's share of a peer's load is its header read alone
    one.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(paths["llama"].glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file(tensors, one / "model.safetensors", metadata={"format": "pt"})
    # 2 MB/s a response: slower than a peer, as a store is (engines share this process, its GIL and the machine's
    # cores with the suite: an uncapped loopback store could measure faster than the seeding engine's answers)
    server = RangeServer(root / "store", rate=2e6)
    source = f"{server.url}/llama/"
    # `streamload digest URL --out`: made from the store's object, bound to its ETag: what a peer's blocks are
    # checked against
    write_digests(streamload.inspect(source), out=one / "streamload.digests.json")
    try:
        extra = {"source": source, "cache_dir": str(root / "node-1"), "seed": {"host": "127.0.0.1", "port": 0}}
        first = engine(paths["llama"], "streamload", model_loader_extra_config=extra)
        seeding = _report_of(first)["seeding"]
        # Engine 2 stands for another node: the fetch engine 1 started, named in this process's environment
        # for the engines it starts to adopt (startup/ahead.py), is not its own.
        os.environ.pop(prefetch.ENV, None)
        before, asked, began = server.sent, len(server.requests), time.perf_counter()
        extra = {"source": source, "cache_dir": str(root / "node-2"), "peers": [seeding]}
        os.environ["STREAMLOAD_PEER_TIMEOUT"] = "30"  # a busy machine's pauses are no peer's failure here
        try:
            second = engine(paths["llama"], "streamload", model_loader_extra_config=extra)
        finally:
            os.environ.pop("STREAMLOAD_PEER_TIMEOUT", None)
        joined = round(time.perf_counter() - began, 2)
        run = {"seeding": seeding, "store_sent": server.sent - before, "seconds": joined,
               "store_requests": server.requests[asked:], "node_2": str(root / "node-2"),
               "joiner": {"tokens": tokens(second), "state": state(second)},
               "seeder": {"tokens": tokens(first), "state": state(first)},  # still serving, and seeding
               "seeding_meanwhile": _answers(seeding)}  # fmt: skip
        close(second)
        close(first)
        run["seeding_after_close"] = _answers(seeding)  # it stops with the engine's model
        out["llama/peers"] = run
    finally:
        os.environ.pop(prefetch.ENV, None)  # engine 2's, likewise: no later engine's
        server.close()


def _report_of(llm: Any) -> dict[str, Any]:
    import streamload.integrations.vllm

    return llm.collective_rpc(lambda worker: vars(streamload.integrations.vllm.last_load).copy())[0]


def in_process(root: Path, paths: dict[str, Path]) -> dict[str, Any]:
    out = Timed()
    for name in ("llama", "qwen2-tied", "qwen2-moe"):
        with recording(out, f"{name}/safetensors"):
            llm = engine(paths[name], "safetensors")
            out[f"{name}/safetensors"] = {"tokens": tokens(llm), "state": state(llm)}
            if name == "qwen2-moe":  # vLLM's own in-place reload of the same weights (why overlap refuses MoE)
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(paths[name])})
                out[f"{name}/safetensors/reloaded"] = {"tokens": tokens(llm), "state": state(llm)}
            close(llm)
        with recording(out, f"{name}/streamload", *(["llama/reloaded"] if name == "llama" else [])):
            llm = engine(paths[name], "streamload")
            out[f"{name}/streamload"] = {"tokens": tokens(llm), "state": state(llm)}
            if name == "llama":  # in place, the way RL frameworks push new weights into a running engine
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(paths["llama-new"])})
                out["llama/reloaded"] = {"tokens": tokens(llm), "state": state(llm)}
            close(llm)
    # Compiled and warmed up before the weights are in, then loaded in place (overlap.py): eager and
    # compiled, against vLLM's own loader in the same mode; a MoE on the CPU is refused.
    with recording(out, "llama/overlap"):
        llm = engine(paths["llama"], "streamload", model_loader_extra_config={"overlap": True})
        out["llama/overlap"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)
    from streamload.integrations.vllm.startup import compiled, recorded

    for fmt, extra in (("streamload", {"overlap": True}), ("safetensors", None)):  # streamload's compiles first
        with recording(out, f"llama/compiled/{fmt}", *(["llama/compiled/recorded"] if extra else [])):
            before = compiled.packed(compiled.cache_root())
            llm = engine(paths["llama"], fmt, enforce_eager=False, model_loader_extra_config=extra)
            out[f"llama/compiled/{fmt}"] = {"tokens": tokens(llm), "state": state(llm)}
            if fmt == "streamload":  # the folders its worker compiled into, as `compile-cache publish` reads them
                made = sorted(set(compiled.packed(compiled.cache_root())) - set(before))
                out["llama/compiled/recorded"] = {"recorded": recorded.recorded(paths["llama"]), "made": made,
                                                  "used": _compiled_folder(llm)}  # fmt: skip
            close(llm)
    overlap_moe = {"model_loader_extra_config": {"overlap": True}}
    out["qwen2-moe/overlap"] = error_of(lambda: engine(paths["qwen2-moe"], "streamload", **overlap_moe))
    with recording(out, "llama-new/safetensors"):
        llm = engine(paths["llama-new"], "safetensors")
        out["llama-new/safetensors"] = {"tokens": tokens(llm)}
        close(llm)
    with recording(out, "sync"):
        out["sync"] = weight_sync(root, paths)
    with recording(out, "llama/streamload-whole"):
        llm = engine(paths["llama"], "streamload", model_loader_extra_config={"direct": False, "reader": "posix"})
        out["llama/streamload-whole"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)
    with recording(out, "llama/streamload-http-ahead"):
        http_ahead(root, paths, out)
    with recording(out, "llama/peers"):
        from_peers(root, paths, out)
    out["bad-key"] = error_of(lambda: engine(paths["llama"], "streamload", model_loader_extra_config={"thread": 4}))
    out["bad-value"] = error_of(lambda: engine(paths["llama"], "streamload", model_loader_extra_config={"slots": "2"}))
    broken = root / "llama-missing-shard"
    broken.mkdir()
    for f in paths["llama"].iterdir():
        os.link(f, broken / f.name)
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.unlink()
    out["missing-shard"] = {"error": error_of(lambda: engine(broken, "streamload")), "file": shard.name}
    overlap = {"model_loader_extra_config": {"overlap": True}}  # found after warm-up: the engine does not start
    out["missing-shard/overlap"] = {"error": error_of(lambda: engine(broken, "streamload", **overlap)),
                                    "file": shard.name}  # fmt: skip

    checked_models = make_checked_models(root)
    for name, path in checked_models.items():
        with recording(out, f"check/{name}"):
            out[f"check/{name}"] = checked(path)
    with recording(out, "check/cli"):
        out["check/cli"] = command(["vllm-check", str(checked_models["gpt2"]), "--dtype", "float32"])
    with recording(out, "check/qwen3-moe"):
        out["check/qwen3-moe"] = checked(many_experts(root))
    # Expert parallelism (vLLM's CPU build loads it, but its forward pass crashes: only the weights are
    # compared); the dry run, forced, learns which experts this rank keeps.
    ep = {"enable_expert_parallel": True, "model_loader_extra_config": {"direct": True}}
    with recording(out, "check/qwen3-moe/ep2"):
        out["check/qwen3-moe/ep2"] = checked(many_experts(root, layers=2), tp=2, **ep)
    cooperative = {"model_loader_extra_config": {"cooperative": True}}
    with recording(out, "check/deepseek-v2/tp2"):
        out["check/deepseek-v2/tp2"] = checked(root / "deepseek-v2", tp=2, **cooperative)

    tp = {"safetensors": {}, "streamload": {"verify": True}, "streamload-cooperative": {"cooperative": True},
          "streamload-overlap": {"overlap": True}}  # fmt: skip
    for name in ("llama", "qwen2-moe"):  # tensor parallel: two ranks, a core each
        for label, extra in tp.items():
            if name == "qwen2-moe" and label == "streamload-overlap":  # refused on the CPU (above)
                continue
            with recording(out, f"{name}/tp2/{label}"):
                tensor_parallel(root, paths, name, label, extra, out)
    return out


def tensor_parallel(root: Path, paths: dict[str, Path], name: str, label: str, extra: dict[str, Any],
                    out: dict[str, Any]) -> None:  # fmt: skip
    """Two ranks, a core each; a reload of llama, and reloads that fail."""
    fmt = label.partition("-")[0]
    llm = engine(paths[name], fmt, tensor_parallel_size=2, distributed_executor_backend="mp",
                 model_loader_extra_config=extra)  # fmt: skip
    out[f"{name}/tp2/{label}"] = {"tokens": tokens(llm), "state": state(llm)}
    if label == "streamload-overlap":
        close(llm)
        return
    if name == "llama":  # a reload reads each rank's part, as the load did (vLLM's own: the reference)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(paths["llama-new"])})
        out[f"{name}/tp2/{label}/reloaded"] = {"tokens": tokens(llm), "state": state(llm)}
        if label == "streamload":
            out[f"{name}/tp2/{label}/failed"] = failed_reloads(llm, root, paths)
    close(llm)
    if f"{name}/tp2/{label}/failed" in out:  # the engine whose reloads failed ends with its processes
        deadline = time.monotonic() + 30
        while engine_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        out[f"{name}/tp2/{label}/left"] = sorted(engine_processes())


# What each quantized checkpoint is loaded with, at one rank and at two: streamload's options, each
# against one load by vLLM's default loader (check_modes).
QUANTIZED_MODES = {"default": {}, "direct": {"direct": True}, "whole": {"direct": False}, "verify": {"verify": True}}
QUANTIZED_TP2_MODES = {"default": {}, "cooperative": {"cooperative": True}}
# Scales by channel, and packed int4 in groups along sharded rows with `g_idx`. (Every other layout, and the
# Qwen3-MoE ones, passed at TP=2 as well, ~10-25 s each on 2 cores: `STREAMLOAD_QUANTIZED_TP2=all` runs them;
# left out of the suite for its time.)
QUANTIZED_TP2 = ("w8a8-int8", "gptq")
# Those whose kernels run here (FP8 with block scales and the 4-bit ones on tests/vllm_reference_kernels.py's):
# greedy tokens and `reload_weights`. (W4A16 by channel and GPTQ with and without `g_idx` passed as well,
# ~15 s each on 2 cores: `STREAMLOAD_QUANTIZED_KERNELS=all` runs them; left out of the suite for its time.)
QUANTIZED_KERNELS = ("w8a8-int8", "w8a8-int8-tensor", "fp8-channel", "w4a8", "fp8-block", "w4a16-group", "awq")
if os.environ.get("STREAMLOAD_QUANTIZED_KERNELS") == "all":
    QUANTIZED_KERNELS += ("w4a16-channel", "gptq", "gptq-g-idx")
HALF = {*quantized_layouts.GPTQ_OR_AWQ, "fp8-block"}  # vLLM runs these in float16 or bfloat16 only
# Mixtures of experts (testbed/quantized_layouts.py's MOE_CONFIGS), whose MoE kernels this CPU lacks: vLLM's
# parameters and weight loaders, the experts' forward on tests/vllm_reference_kernels.py's reference, in
# bfloat16 (as their checkpoints are). At TP=2, gpt-oss (its own load_weights narrows the fused experts, with
# their scales, and zeroes on rank 1 the down projection's bias it is handed).
QUANTIZED_MOE_TP2 = ("gpt-oss-mxfp4",)
if os.environ.get("STREAMLOAD_QUANTIZED_TP2") == "all":
    QUANTIZED_TP2, QUANTIZED_MOE_TP2 = tuple(quantized_layouts.CONFIGS), tuple(quantized_layouts.MOE_CONFIGS)


def _dtype(layout: str) -> str:
    return "bfloat16" if layout in HALF else "float32"


def quantized(root: Path) -> dict[str, Any]:
    """Every quantization vLLM's CPU build loads, in its real layout (testbed/quantized_layouts.py): every
    tensor right after `load_weights` against vLLM's default loader in each mode; where the kernel runs
    here, greedy tokens and an in-place reload of other weights, against vLLM's own loader and reload."""
    from streamload.integrations.vllm.check import check_modes
    from streamload.pipeline.verify import write_digests

    out = Timed()
    paths = quantized_layouts.make(root, SMALL)
    new = quantized_layouts.make(root, SMALL, list(QUANTIZED_KERNELS), seed=31)
    for path in paths.values():  # `streamload digest`: what verify=True checks against
        write_digests(streamload.inspect(path))
    for layout, path in paths.items():
        dtype = _dtype(layout)
        with recording(out, f"check/quantized/{layout}"):
            _broken()
            for mode, report in check_modes(str(path), QUANTIZED_MODES, dtype=dtype, **KV_CACHE).items():
                out[f"check/quantized/{layout}/{mode}"] = _checked(report)
        if layout in QUANTIZED_TP2:
            with recording(out, f"check/quantized/{layout}/tp2"):
                for mode, report in check_modes(str(path), QUANTIZED_TP2_MODES, tp=2, dtype=dtype, **KV_CACHE).items():
                    out[f"check/quantized/{layout}/tp2/{mode}"] = _checked(report)
    # Before the refused load below: a MoE engine after it fails here ("expert parallel group is not
    # initialized"), the failed dense engine's parallel state (without one) left behind in this process.
    quantized_moe(root, out)
    # With verify: a packed weight with a flipped byte is refused, naming the file and the tensor.
    flipped = root / "gptq-flipped"
    shutil.copytree(paths["gptq"], flipped)
    packed = streamload.inspect(flipped).tensors["model.layers.1.mlp.down_proj.qweight"]
    with open(packed.path, "r+b") as f:
        f.seek(packed.begin + 100)
        byte = f.read(1)[0]
        f.seek(packed.begin + 100)
        f.write(bytes([byte ^ 0x10]))
    verify = {"model_loader_extra_config": {"verify": True}, "dtype": "bfloat16"}
    out["quantized/gptq/verify-flipped"] = error_of(lambda: engine(flipped, "streamload", **verify))
    for layout in QUANTIZED_KERNELS:
        dtype = _dtype(layout)
        for fmt in ("safetensors", "streamload"):
            with recording(out, f"quantized/{layout}/{fmt}"):
                generated_and_reloaded(paths[layout], new[layout], fmt, f"quantized/{layout}/{fmt}", out, dtype=dtype)
        with recording(out, f"quantized/{layout}/new"):
            llm = engine(new[layout], "safetensors", dtype=dtype)  # a fresh engine on the reload's weights
            out[f"quantized/{layout}/new"] = {"tokens": tokens(llm), "state": state(llm)}
            close(llm)
    return out


def generated_and_reloaded(path: Path, new: Path, fmt: str, key: str, out: dict[str, Any], dtype: str) -> None:
    """Greedy tokens and every parameter of an engine on `path`, and again after an in-place reload of `new`."""
    llm = engine(path, fmt, dtype=dtype)
    run = {"tokens": tokens(llm), "state": state(llm)}
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new)})
    out[key] = run | {"reloaded": {"tokens": tokens(llm), "state": state(llm)}}
    close(llm)


def quantized_moe(root: Path, out: dict[str, Any]) -> None:
    """Quantized mixtures of experts (compressed-tensors W4A16, FP8 with block scales, gpt-oss's MXFP4)
    whose MoE kernels this CPU lacks: every tensor right after `load_weights` against vLLM's default loader
    in each mode (and at TP=2); greedy tokens from both loaders on the reference kernels, and after an
    in-place reload of other weights."""
    from streamload.integrations.vllm.check import check_modes
    from streamload.pipeline.verify import write_digests

    paths = quantized_layouts.make_moe(root)
    (root / "reloaded").mkdir()
    new = quantized_layouts.make_moe(root / "reloaded", seed=41)
    for layout, path in paths.items():
        write_digests(streamload.inspect(path))
        with recording(out, f"check/quantized/{layout}"):
            _broken()
            for mode, report in check_modes(str(path), QUANTIZED_MODES, dtype="bfloat16", **KV_CACHE).items():
                out[f"check/quantized/{layout}/{mode}"] = _checked(report)
        if layout in QUANTIZED_MOE_TP2:
            with recording(out, f"check/quantized/{layout}/tp2"):
                modes = check_modes(str(path), QUANTIZED_TP2_MODES, tp=2, dtype="bfloat16", **KV_CACHE)
                for mode, report in modes.items():
                    out[f"check/quantized/{layout}/tp2/{mode}"] = _checked(report)
        for fmt in ("safetensors", "streamload"):
            with recording(out, f"quantized/{layout}/{fmt}"):
                generated_and_reloaded(path, new[layout], fmt, f"quantized/{layout}/{fmt}", out, dtype="bfloat16")


def _checked(report: Any) -> dict[str, Any]:
    return {"ok": report.ok, "differences": report.differences, "tensors": report.tensors, "report": report.streamload}


def compiled_tensor_parallel(root: Path) -> dict[str, Any]:
    """The slow scenario (`--compiled-tp2`, minutes here): overlap at TP=2 with vLLM's compilation,
    against vLLM's own loader compiled at TP=2."""
    paths = make_models(root)
    out: dict[str, Any] = {}
    for fmt, extra in (("safetensors", None), ("streamload", {"overlap": True})):
        tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
        llm = engine(paths["llama"], fmt, enforce_eager=False, model_loader_extra_config=extra, **tp2)
        out[f"llama/tp2/compiled/{fmt}"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)
    return out


ENGINES_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engines in this process: ~4 s each, not ~35 s
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with our own functions
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # a core per tensor-parallel rank
}
SUITE_ENVIRONMENT: dict[str, str] = {}  # the suite's, for the processes of their own (fresh_processes)


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

    gc.collect()
    collect_what_engines_make()
    with tempfile.TemporaryDirectory() as tmp:
        if "--compiled-tp2" in sys.argv:
            results = compiled_tensor_parallel(Path(tmp)) | {"seconds": {}}
        elif "--fresh" in sys.argv:  # the suite starts the three parts together (conftest.py)
            results = fresh_processes(Path(tmp)) | {"seconds": {}}
        elif "--quantized" in sys.argv:
            results = quantized(Path(tmp))
            results = {**results, "seconds": results.seconds}
        elif "--engines" in sys.argv:
            results = run(Path(tmp))
        else:
            results = run(Path(tmp)) | fresh_processes(Path(tmp)) | quantized(Path(tmp))
    results["seconds"]["all"] = round(time.perf_counter() - started, 2)
    results["errors"] = ERRORS  # the keys whose engine raised: their tests fail with it (tests/conftest.py)
    Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
