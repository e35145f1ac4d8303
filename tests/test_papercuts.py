"""What a new user met: each mistake or unkind machine (a file where a folder goes, a read-only or full
disk, a server that never answers, a mistyped path or rule) answered in one line naming it, exit
status 1, no traceback; and the README's test command as CI runs it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.commands.demo import Shape, write_checkpoint
from streamload.plan.shard import ShardSpec

from .conftest import Mount
from .servers import RangeServer

ROOT = Path(__file__).parent.parent


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real command, in its own process (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "streamload", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)  # fmt: skip


def one_line_error(run: subprocess.CompletedProcess[str], *named: str) -> str:
    """The run failed with status 1 and one `streamload: error:` line naming each of `named`, no traceback."""
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("streamload: error:")]
    assert len(errors) == 1, run.stderr
    for text in named:
        assert text in errors[0], errors[0]
    return errors[0]


def small_checkpoint(folder: Path) -> Path:
    write_checkpoint(folder, Shape(vocab=64, hidden=32, intermediate=48, layers=2), shards=2)
    return folder


# -- streamload demo --keep ----------------------------------------------------------------------------


def test_demo_keep_onto_an_existing_file_is_one_line_and_leaves_the_file(tmp_path: Path) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    one_line_error(cli("demo", "--warm", "--device", "cpu", "--keep", str(existing)), str(existing), "not a directory")
    assert existing.read_text() == "mine"


def test_demo_keep_in_a_read_only_place_is_one_line(mount: Mount) -> None:
    read_only = mount(read_only=True)
    for target in (read_only, read_only / "demo"):  # the folder itself, and one to be made there
        line = one_line_error(cli("demo", "--warm", "--device", "cpu", "--keep", str(target)), str(target))
        assert "Read-only file system" in line or "not writable" in line, line


def test_demo_keep_on_a_full_disk_is_one_line_and_leaves_no_half_written_shard(mount: Mount) -> None:
    disk = mount(size=1 << 20)  # the demo's checkpoint is ~0.4 GB
    line = one_line_error(cli("demo", "--warm", "--device", "cpu", "--keep", str(disk / "demo")), str(disk / "demo"))
    assert "No space left on device" in line, line
    assert list((disk / "demo").iterdir()) == []


# -- streamload digest ---------------------------------------------------------------------------------


def test_digest_of_a_read_only_folder_names_the_folder(mount: Mount) -> None:
    folder = mount(fill=small_checkpoint, read_only=True)
    line = one_line_error(cli("digest", str(folder)), f"{folder}: cannot write streamload.digests.json there")
    assert ".streamload.digests.json." not in line  # the folder, not a temporary file's name


def test_digest_on_a_full_disk_names_the_folder_and_leaves_no_temporary_file(mount: Mount) -> None:
    def fill(point: Path) -> None:
        small_checkpoint(point)
        with open(point / "filler", "wb", buffering=0) as f:  # every byte left taken
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass

    folder = mount(size=1 << 20, fill=fill)
    one_line_error(cli("digest", str(folder)), str(folder), "No space left on device")
    assert sorted(p.name for p in folder.iterdir() if "digests" in p.name) == []


# -- the README's test command ---------------------------------------------------------------------------


def test_the_readmes_test_command_updates_apt_first_says_how_long_and_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    paragraph, block = re.search(r"(This installs the test extras.*?)```sh\n(.*?)\n```", readme, re.S).groups()  # type: ignore[union-attr]
    assert "minutes" in paragraph and "2 cores" in paragraph
    assert block.startswith("(apt-get update -q && apt-get install -y -q nginx-light"), block
    assert '|| echo "no nginx: the network tests will skip")' in block  # without root or apt, the rest still runs
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == block
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0


# -- a server that accepts connections and never answers ---------------------------------------------


@pytest.fixture
def silent_server() -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # and never a byte back
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/model/"
    stop.set()
    listener.close()
    for conn in held:
        conn.close()


def test_an_unanswering_server_is_logged_as_it_is_waited_for_then_named(silent_server: str) -> None:
    env = {**os.environ, "STREAMLOAD_TIMEOUT": "1", "STREAMLOAD_RETRIES": "2"}
    started = time.monotonic()
    run = cli("load", silent_server, "--device", "cpu", env=env, timeout=120)
    assert time.monotonic() - started < 60
    waits = [line for line in run.stderr.splitlines() if "got no answer within 1 s; trying again" in line]
    assert len(waits) == 2 and all(silent_server in line for line in waits), run.stderr
    one_line_error(run, silent_server, "got no answer within 1 s in 3 of 3 attempts", "STREAMLOAD_TIMEOUT")


# -- cache_dir -------------------------------------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    folder = tmp_path / "served"
    folder.mkdir()
    tensors = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, folder / "model.safetensors")
    server = RangeServer(folder)
    try:
        yield f"{server.url}/", tensors
    finally:
        server.close()


def test_a_cache_dir_that_cannot_be_written_is_one_warning_naming_it_and_the_load_goes_on(
    served: tuple[str, dict[str, torch.Tensor]], tmp_path: Path, mount: Mount
) -> None:
    """At efa38a3 each of these ended the load: `loading failed: NotADirectoryError: ...` (or
    `OSError: Read-only file system`) naming a folder deep inside the cache."""
    url, _ = served
    a_file = tmp_path / "cache-file"
    a_file.write_text("")
    read_only = mount(read_only=True)
    for cache in (a_file, a_file / "sub", read_only, read_only / "sub"):
        run = cli("load", url, "--device", "cpu", "--cache-dir", str(cache), timeout=120)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        warned = [line for line in run.stderr.splitlines() if "cannot keep copies there" in line]
        assert len(warned) == 1 and warned[0].startswith(f"streamload: cache_dir {cache}: "), run.stderr
        assert "reads from the store without keeping them" in warned[0]
        assert run.stdout.splitlines()[-1].startswith("2 tensors, "), run.stdout
    assert a_file.read_text() == "" and list(read_only.iterdir()) == []


def test_a_read_only_cache_that_holds_the_checkpoint_is_still_read(
    served: tuple[str, dict[str, torch.Tensor]], mount: Mount
) -> None:
    url, tensors = served
    cache = mount(fill=lambda point: streamload.load(url, device="cpu", cache_dir=point), read_only=True)
    got = streamload.load(url, device="cpu", cache_dir=cache)  # nothing to write: refused for nothing before
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


# -- vllm-check ------------------------------------------------------------------------------------------


def test_vllm_check_of_a_path_that_is_not_there_is_one_line_before_vllm_is_imported(tmp_path: Path) -> None:
    started = time.monotonic()
    for missing in ("/nope", str(tmp_path / "model"), "./model-typo"):
        one_line_error(cli("vllm-check", missing, timeout=60), f"{missing}: no such directory")
    assert time.monotonic() - started < 30  # vLLM's imports alone take ~20 s


def test_vllm_check_api_names_a_missing_path_and_a_file(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from streamload.base.errors import MissingFileError, SourceError
    from streamload.integrations.vllm.check import check

    with pytest.raises(MissingFileError, match=r"^/nope: no such directory \(nor a Hugging Face model id\)$"):
        check("/nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SourceError, match="not a model directory"):
        check(str(tmp_path / "model.safetensors"))


def vllm_check_without_cpu_variables(folder: Path, environment: dict[str, str]) -> dict[str, Any]:
    """`streamload vllm-check` of a tiny Llama, where none of vLLM's VLLM_CPU_* variables is set: run by
    the engines (tests/vllm_engines.py, beside the suite)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "tiny")
    env = {k: v for k, v in environment.items() if not k.startswith("VLLM_CPU_")}
    run = cli("vllm-check", str(folder / "tiny"), env=env, timeout=400)
    return {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}


def test_vllm_check_runs_on_a_cpu_without_vllms_cpu_variables(engines: dict[str, Any]) -> None:
    """vLLM's CPU worker reserves 92% of the machine's memory for its KV cache unless told otherwise, and
    refuses to start where less is free: the check sizes the cache for its 256 tokens itself."""
    run = engines["vllm-check/without-cpu-variables"]
    assert run["returncode"] == 0, run["stderr"][-3000:]
    agree = r"streamload and vLLM's default loader agree: 1 rank, \d+ tensors each, byte for byte$"
    assert re.search(agree, run["stdout"]), run["stdout"]


# -- ShardSpec ---------------------------------------------------------------------------------------------


def test_shard_rules_that_are_not_rules_are_a_type_error_saying_what_rules_are() -> None:
    with pytest.raises(TypeError, match=r"rules must be a mapping of fnmatch patterns .* not str 'lm_head'"):
        ShardSpec("lm_head", rank=0, world_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ShardSpec rule '\*.q_proj.weight': str '0' is not a dimension"):
        ShardSpec({"*.q_proj.weight": "0"}, rank=0, world_size=2)
    with pytest.raises(TypeError, match=r"ShardSpec rule 0: patterns must be text"):
        ShardSpec({0: 0}, rank=0, world_size=2)  # type: ignore[dict-item]
    assert ShardSpec({"a": 0, "b": None, "c": ShardSpec.SKIP, "d": -1}, rank=0, world_size=2).rank == 0


def test_shard_rules_that_match_no_tensor_are_named(tmp_path: Path) -> None:
    save_file({"model.q_proj.weight": torch.arange(8.0).reshape(4, 2), "lm_head.weight": torch.ones(2, 2)},
              tmp_path / "model.safetensors")  # fmt: skip
    typo = ShardSpec({"*.q_proj.weight": 0, "*.qproj.weight": 1, "lm-head*": 0}, rank=1, world_size=2)
    with pytest.warns(UserWarning, match=r"ShardSpec rules '\*.qproj.weight', 'lm-head\*' match none of the "
                      r"checkpoint's 2 tensors"):  # fmt: skip
        got = streamload.load(tmp_path, device="cpu", shard=typo)
    assert torch.equal(got["model.q_proj.weight"], torch.arange(8.0).reshape(4, 2)[2:])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streamload.load(tmp_path, device="cpu", shard=ShardSpec({"*.q_proj.weight": 0}, rank=0, world_size=2))


# -- publish -----------------------------------------------------------------------------------------------


def test_publish_names_what_is_not_a_tensor_and_writes_nothing(tmp_path: Path) -> None:
    from streamload.commands.publish import publish

    cases: list[tuple[object, str]] = [
        ({"a": 3}, "tensor 'a': must be a torch.Tensor, not int 3"),
        ({"w": torch.ones(2), "b": [1.0]}, "tensor 'b': must be a torch.Tensor, not list"),
        ({1: torch.ones(2)}, "tensor names must be text, not int 1"),
        ([("a", torch.ones(2), "extra")], "tensors must be a mapping or (name, tensor) pairs"),
        (torch.ones(2), "tensors must be a mapping of names to tensors, not Tensor"),
    ]
    for tensors, message in cases:
        with pytest.raises(TypeError, match=re.escape(message)):
            publish(tensors, tmp_path / "run", step=1)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
    assert publish({"a": torch.ones(2)}, tmp_path / "run", step=1).name == "step-1"


# -- from_pretrained's strict= hint ------------------------------------------------------------------------


@pytest.fixture
def llama(tmp_path: Path) -> Callable[[str, Callable[[dict[str, torch.Tensor]], object]], Path]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")

    def variant(name: str, edit: Callable[[dict[str, torch.Tensor]], object]) -> Path:
        folder = tmp_path / name
        shutil.copytree(tmp_path / "llama", folder)
        state = load_file(folder / "model.safetensors")
        edit(state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return folder

    return variant


def _gptq(state: dict[str, torch.Tensor]) -> None:
    w = state.pop("model.layers.0.mlp.down_proj.weight")
    state["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32)
    state["model.layers.0.mlp.down_proj.scales"] = torch.ones(1, w.shape[0], dtype=torch.float16)


@pytest.mark.parametrize("strict", [True, False])
def test_a_quantized_checkpoint_is_named_and_strict_false_is_not_offered(llama: Callable, strict: bool) -> None:
    folder = llama("gptq", _gptq)
    with pytest.raises(streamload.UnsupportedError) as caught:
        streamload.from_pretrained(folder, device="cpu", strict=strict)
    text = str(caught.value)
    assert "the checkpoint is quantized (it holds 'model.layers.0.mlp.down_proj.qweight'" in text, text
    assert "with strict=False it would load wrong values or none" in text and "nothing was read" in text
    assert "missing keys: 'model.layers.0.mlp.down_proj.weight'" in text
    assert "pass strict=False" not in text


@pytest.mark.parametrize("strict", [True, False])
def test_a_missing_parameter_says_strict_false_does_not_help(llama: Callable, strict: bool) -> None:
    """strict=False used to be offered here, and then failed in torch ('Cannot copy out of meta tensor')."""
    folder = llama("missing", lambda state: state.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(streamload.StreamloadError) as caught:
        streamload.from_pretrained(folder, device="cpu", strict=strict)
    text = str(caught.value)
    assert text.startswith("loading into LlamaForCausalLM: missing keys: 'model.layers.1.mlp.up_proj.weight'; "
                           "nothing was read."), text  # fmt: skip
    assert "strict=False does not help: the model's 'model.layers.1.mlp.up_proj.weight' would have no values" in text
    assert "pass strict=False" not in text


def test_an_unexpected_key_offers_strict_false_which_then_loads(llama: Callable, tmp_path: Path) -> None:
    folder = llama("extra", lambda state: state.update({"model.layers.1.mlp.extra": torch.ones(2)}))
    offer = r", or pass strict=False to load the keys that match: the unexpected keys are ignored$"
    with pytest.raises(
        streamload.StreamloadError, match=r"unexpected keys: 'model.layers.1.mlp.extra'; nothing was read\."
    ):
        streamload.from_pretrained(folder, device="cpu")
    with pytest.raises(streamload.StreamloadError, match=offer):
        streamload.from_pretrained(folder, device="cpu")
    model = streamload.from_pretrained(folder, device="cpu", strict=False)
    reference = load_file(tmp_path / "llama" / "model.safetensors")
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, reference["model.layers.1.mlp.up_proj.weight"])


# -- compile-cache publish ---------------------------------------------------------------------------------


def test_compile_cache_publish_refuses_a_checkpoint_that_is_not_there(tmp_path: Path) -> None:
    cache_root = tmp_path / "vllm-cache"
    (cache_root / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache_root / "torch_compile_cache" / "abc" / "artifact").write_text("compiled")
    missing = tmp_path / "typo-model"
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    for target in (missing, a_file):
        run = cli("compile-cache", "publish", str(target), "--cache-root", str(cache_root), timeout=120)
        one_line_error(run, f"{target}: no such checkpoint directory")
    assert not missing.exists() and a_file.read_bytes() == b""


# -- shapes that disagree with the model -------------------------------------------------------------------


def test_load_into_refuses_a_tensor_of_another_shape_than_its_parameter_before_reading(tmp_path: Path) -> None:
    """torch's load_state_dict says "size mismatch"; a weight of another shape assigned under the
    module's declared one would load silently and fail (or compute garbage) later."""
    save_file({"lm_head.weight": torch.ones(64, 32), "lm_head.bias": torch.ones(64)}, str(tmp_path / "m.safetensors"))
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(30, 64)
    before = model.lm_head.weight.detach().clone()
    said = (r"loading into Module: shapes differ: .*m.safetensors: tensor 'lm_head.weight' is \[64, 32\], parameter "
            r"'lm_head.weight' is \[64, 30\]; nothing was read")  # fmt: skip
    for strict in (True, False):
        with pytest.raises(streamload.StreamloadError, match=said):
            streamload.load_into(model, tmp_path, include="lm_head*", strict=strict)
    assert torch.equal(model.lm_head.weight, before)


def test_from_pretrained_names_the_config_field_a_shape_came_from(tmp_path: Path) -> None:
    """A config.json whose intermediate_size disagrees with the weights: refused before reading (as
    transformers refuses without ignore_mismatched_sizes), naming tensor, both shapes and the field."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    edited = json.loads((tmp_path / "config.json").read_text()) | {"intermediate_size": 200}
    (tmp_path / "config.json").write_text(json.dumps(edited))
    said = (
        r"tensor 'model.layers.0.mlp.down_proj.weight' is \[64, 256\], parameter "
        r"'model.layers.0.mlp.down_proj.weight' is \[64, 200\] \(the config's intermediate_size = 200\)"
        r".*nothing was read"
    )
    with pytest.raises(streamload.StreamloadError, match=said):
        streamload.from_pretrained(tmp_path, device="cpu")


def test_from_pretrained_on_a_config_that_is_not_json_names_the_file(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{nope")
    pytest.importorskip("transformers")
    with pytest.raises(
        streamload.StreamloadError, match=rf"{tmp_path}/config.json: transformers cannot read this config"
    ):
        streamload.from_pretrained(tmp_path, device="cpu")


# -- a fleet that cannot form --------------------------------------------------------------------------------


def test_a_fleet_address_that_does_not_resolve_fails_at_once_naming_it(tmp_path: Path) -> None:
    fleet = streamload.Fleet("nohost.invalid:29511", world_size=2, rank=1)  # waits 5 minutes by default
    started = time.monotonic()
    with pytest.raises(
        streamload.StreamloadError, match=r"fleet at nohost.invalid:29511 as rank 1 of 2: cannot resolve"
    ):
        streamload.load(small_checkpoint(tmp_path), cooperative=fleet)
    assert time.monotonic() - started < 30


def test_a_member_waiting_for_rank_0_says_so_and_gives_up_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import datetime

    from streamload.cooperative import fleet as fleets

    monkeypatch.setattr(fleets, "_SAY_AFTER", 0.5)
    monkeypatch.setattr(fleets, "_SAY_EVERY", 1.0)
    with socket.socket() as s:  # a port nothing listens on (rank 0 never started)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    fleet = streamload.Fleet(address, world_size=2, rank=1, timeout=datetime.timedelta(seconds=3))
    threads = threading.active_count()
    started = time.monotonic()
    with pytest.raises(
        streamload.StreamloadError, match=rf"{address} as rank 1 of 2: nothing served the fleet's store"
    ):
        streamload.load(small_checkpoint(tmp_path), cooperative=fleet)
    assert 2.5 < time.monotonic() - started < 15
    said = [r.getMessage() for r in caplog.records if "waiting for rank 0 to serve the fleet's store" in r.getMessage()]
    assert len(said) >= 2 and all(address in line and "of at most 3 s" in line for line in said), said
    assert threading.active_count() == threads  # the thread that said it ended with the wait


# -- vLLM's --model-loader-extra-config, checked where the engine's config is built ----------------------------


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            {"bogus": 1},
            "unknown model_loader_extra_config keys for load format 'streamload': bogus; known keys: reader",
        ),
        ({"threads": "many"}, "model_loader_extra_config['threads'] must be an int, not 'many'"),
        ({"source": "/nonexistent/dir"}, "model_loader_extra_config['source']: /nonexistent/dir: no such file or"),
    ],
)
def test_bad_loader_options_are_one_line_before_the_engine_starts(extra: dict[str, Any], said: str) -> None:
    """What vLLM's `create_load_config` (patched in the process that starts the engine, before any
    worker) calls: a wrong key, a wrong type and a source that is not there each one line, no traceback
    from a worker a minute later (the engines' own run asserts the first two through a real engine)."""
    from streamload.integrations.vllm.options import check_options

    with pytest.raises(ValueError, match=re.escape(said)):
        check_options(extra)
    assert check_options({"source": "s3://bucket/model/"}) == {"source": "s3://bucket/model/"}  # not looked up here


def test_compile_cache_publish_onto_a_read_only_checkpoint_is_one_line(mount: Mount, tmp_path: Path) -> None:
    cache_root = tmp_path / "vllm-cache"
    (cache_root / "torch_compile_cache" / "abc").mkdir(parents=True)
    (cache_root / "torch_compile_cache" / "abc" / "artifact").write_text("compiled")
    folder = mount(fill=small_checkpoint, read_only=True)
    run = cli("compile-cache", "publish", str(folder), "--cache-root", str(cache_root), timeout=120)
    line = one_line_error(run, str(folder))
    assert "Read-only file system" in line or "not writable" in line, line


def test_from_pretrained_takes_torch_dtype_as_transformers_does_and_refuses_an_unknown_option_first(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = streamload.from_pretrained(tmp_path, device="cpu", torch_dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with pytest.raises(ValueError, match="give dtype= or torch_dtype= .*not both"):
        streamload.from_pretrained(tmp_path, device="cpu", dtype=torch.float16, torch_dtype=torch.float16)
    with pytest.raises(TypeError, match="from_pretrained\\(\\) got unexpected keyword arguments: low_cpu_mem_usage"):
        streamload.from_pretrained(tmp_path, device="cpu", low_cpu_mem_usage=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_bench_on_a_device_this_machine_lacks_is_one_line_before_any_run(tmp_path: Path) -> None:
    run = cli("bench", str(small_checkpoint(tmp_path)), "--device", "cuda", timeout=120)
    one_line_error(run, "device cuda: this torch sees no CUDA device")
    assert "run 1/" not in run.stderr + run.stdout


def test_prefetch_is_a_subcommand_as_the_readme_shows(tmp_path: Path) -> None:
    folder = small_checkpoint(tmp_path)
    run = cli("prefetch", str(folder), timeout=120)
    assert run.returncode == 0 and f"prefetched {folder}: " in run.stdout, run.stderr
    one_line_error(cli("prefetch", str(tmp_path / "typo"), timeout=120), str(tmp_path / "typo"))
    assert "streamload prefetch PATH|URL" in (ROOT / "README.md").read_text()


def test_the_readmes_engine_snippets_run_as_scripts() -> None:
    """vLLM starts its workers by spawning, which imports the script again: an `LLM(...)` at a script's
    top level starts engines without end (or fails); every snippet of the README and docs/ that builds one guards it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    engines = [b for b in blocks if "= LLM(" in b]
    assert len(engines) >= 5
    for block in engines:
        guard = block.index('if __name__ == "__main__":')
        assert all(guard < m.start() for m in re.finditer(r"= LLM\(", block)), block


def test_a_passing_tests_temporary_files_are_not_kept(tmp_path: Path) -> None:
    """The suite writes gigabytes of checkpoints under pytest's temporary directory: with this
    project's settings only a failed test's are kept to look at (pytest keeps every test's of the last
    three runs otherwise: ~1.3 GB)."""
    (tmp_path / "test_two.py").write_text(
        "def test_passes(tmp_path):\n    (tmp_path / 'ckpt').write_bytes(b'x')\n\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'ckpt').write_bytes(b'x')\n    assert False\n"
    )
    base = tmp_path / "base"
    argv = ["-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
            "--basetemp", str(base), str(tmp_path / "test_two.py")]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "pytest", *argv], capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    kept = sorted(p.name for p in base.iterdir() if not p.is_symlink()) if base.exists() else []
    assert kept == ["test_fails0"], kept
