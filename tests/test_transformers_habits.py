"""What transformers users expect of `streamload.from_pretrained` and `load`: a progress bar on a terminal
(where transformers draws its "Loading weights", and switched off by the same switches), `device_map=`
naming one device, and `trust_remote_code=True` running the folder's own model code as transformers does."""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import streamload
from streamload.commands.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("tqdm")

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128}  # fmt: skip
BAR = "Loading weights"
SWITCHES = ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "STREAMLOAD_PROGRESS_AFTER")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def _stderr(code: str, env: dict[str, str], terminal: bool) -> str:
    """What `python -c code` writes on its stderr: a pseudo-terminal of 100 x 24 (`terminal`), else a pipe."""
    env = {**{k: v for k, v in os.environ.items() if k not in SWITCHES}, **env}
    argv = [sys.executable, "-c", code]
    if not terminal:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=env, timeout=300, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stderr
    import fcntl
    import pty
    import termios

    master, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=child_end, env=env)
    finally:
        os.close(child_end)
    chunks: list[bytes] = []
    try:
        while select.select([master], [], [], 300)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's end closed
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        if proc.poll() is None and not chunks:
            proc.kill()
        rc = proc.wait(timeout=60)
    out = b"".join(chunks).decode(errors="replace")
    assert rc == 0, out
    return out


def _segments(out: str) -> dict[str, str]:
    """{marker: what was written after it, up to the next}: the script marks each load with `@@ name`."""
    parts = out.split("@@ ")[1:]
    return {p.split(None, 1)[0]: p.split(None, 1)[1] if len(p.split(None, 1)) > 1 else "" for p in parts}


def _script(llama: Path, *steps: str) -> str:
    head = ("import os, sys, streamload\nfrom streamload.commands.cli import main\n"
            f"folder = {str(llama)!r}\nfile = os.path.join(folder, 'model.safetensors')\n"
            "def mark(name): print('@@', name, file=sys.stderr, flush=True)\n")  # fmt: skip
    return head + "\n".join(steps) + "\nmark('end')\n"


LOAD = "mark('load'); streamload.load(file, device='cpu')"
PRETRAINED = "mark('pretrained'); streamload.from_pretrained(folder, device='cpu')"
CLI = "mark('cli'); main(['load', file, '--device', 'cpu'])"
SWITCHED = (  # transformers' and the hub's own switches, then the threshold, each turned back on after
    "import transformers, huggingface_hub.utils as hub",
    "transformers.logging.disable_progress_bar()",
    LOAD.replace("'load'", "'off_transformers'"),
    PRETRAINED.replace("'pretrained'", "'off_transformers_pretrained'"),
    "transformers.logging.enable_progress_bar()",
    "hub.disable_progress_bars()",
    LOAD.replace("'load'", "'off_hub'"),
    "hub.enable_progress_bars()",
    "os.environ['STREAMLOAD_PROGRESS_AFTER'] = '600'",
    LOAD.replace("'load'", "'below_threshold'"),
    "os.environ['STREAMLOAD_PROGRESS_AFTER'] = '0'",
    LOAD.replace("'load'", "'on_again'"),
)
# from_pretrained whose last step (the model's `eval()`, after every byte was read) takes 1.5 s: what the bar
# shows meanwhile is before the `returning` mark, its last drawing after it
SLOW_RETURN = (
    "import time, transformers\n_eval = transformers.LlamaForCausalLM.eval\n"
    "def _slow(self, *a, **k):\n    time.sleep(1.5); mark('returning')\n"
    "    transformers.LlamaForCausalLM.eval = _eval; return _eval(self, *a, **k)\n"
    "transformers.LlamaForCausalLM.eval = _slow",
    PRETRAINED.replace("'pretrained'", "'pretrained_slow'"),
)
# The programs the tests read (their steps, their environment, on a terminal or a pipe), each in an
# interpreter of its own (a switch read at import needs one) and all started at once by `runs`: each is
# mostly imports, ~5 s of one core. On a terminal the bar is drawn, then the switches turn it off, in one
# program: with the threshold at 0 s from its start, no bar after a switch is the switch's doing.
PROGRAMS: dict[str, tuple[tuple[str, ...], dict[str, str], bool]] = {
    "terminal": ((LOAD, PRETRAINED, CLI, *SLOW_RETURN, *SWITCHED), {"STREAMLOAD_PROGRESS_AFTER": "0"}, True),
    "pipe": ((LOAD, PRETRAINED), {"STREAMLOAD_PROGRESS_AFTER": "0"}, False),
    "hub_switch": ((LOAD, PRETRAINED), {"STREAMLOAD_PROGRESS_AFTER": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}, True),
}


@pytest.fixture(scope="module")
def runs(llama: Path) -> Iterator[dict[str, Future[str]]]:
    """Each of `PROGRAMS`' stderr, the programs run side by side (a test reads its own: a program that
    fails fails its test alone)."""
    with ThreadPoolExecutor(len(PROGRAMS)) as pool:
        yield {name: pool.submit(_stderr, _script(llama, *steps), env, terminal)
               for name, (steps, env, terminal) in PROGRAMS.items()}  # fmt: skip


def test_a_load_on_a_terminal_draws_a_bar(llama: Path, runs: dict[str, Future[str]]) -> None:
    """`load`, `from_pretrained` and the CLI's `load` on a terminal each draw one bar that ends at 100%;
    the threshold lowered to 0 s (a small checkpoint loads faster than the default 1 s)."""
    out = _segments(runs["terminal"].result())
    for name in ("load", "pretrained"):
        assert BAR in out[name] and "100%" in out[name], (name, out[name])
    assert "loading" in out["cli"] and "100%" in out["cli"], out["cli"]
    from streamload.base.progress import size

    total = size(sum(t.nbytes for t in streamload.inspect(llama).tensors.values()))
    assert total.endswith(" KB")  # a small checkpoint: its bar counts kB, not "0.00 GB"
    assert "kB/" in out["load"] and "0.00GB" not in out["load"]


def test_the_bar_reaches_100_percent_only_as_the_load_returns(runs: dict[str, Future[str]]) -> None:
    """Every byte read, but from_pretrained not done (its model's `eval()` takes 1.5 s here): the bar is not
    at 100% meanwhile; it is once the call returns."""
    out = _segments(runs["terminal"].result())
    during, after = out["pretrained_slow"], out["returning"]
    assert BAR in during and "100%" not in during, during
    assert "100%" in after, after


def test_nothing_is_drawn_into_a_pipe(runs: dict[str, Future[str]]) -> None:
    out = runs["pipe"].result()
    assert set(_segments(out)) == {"load", "pretrained", "end"}
    assert BAR not in out and "%|" not in out


def test_hf_hub_disable_progress_bars_turns_it_off_on_a_terminal(runs: dict[str, Future[str]]) -> None:
    out = runs["hub_switch"].result()
    assert set(_segments(out)) == {"load", "pretrained", "end"}
    assert BAR not in out and "%|" not in out


def test_transformers_and_hub_switches_and_the_threshold_turn_it_off(runs: dict[str, Future[str]]) -> None:
    """transformers' `logging.disable_progress_bar()`, huggingface_hub's `disable_progress_bars()`, and a
    load shorter than the threshold draw nothing; switched back on, the bar is back."""
    out = _segments(runs["terminal"].result())
    for name in ("off_transformers", "off_transformers_pretrained", "off_hub", "below_threshold"):
        assert BAR not in out[name], (name, out[name])
    assert BAR in out["on_again"] and "100%" in out["on_again"]


def test_sizes_are_shown_in_units_that_suit_them(llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(llama / "model.safetensors"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "%" in line]
    assert lines and all(" KB " in line for line in lines), out  # the CLI's lines on a small model
    assert "0.00 GB" not in out and " KB to cpu via " in out
    from streamload.base.progress import size

    assert [size(n) for n in (0, 999, 1000, 1536, 999_400, 999_999, 12_345_678, 1_234_567_890, 5e12)] == [
        "0 B", "999 B", "1.0 KB", "1.5 KB", "999.4 KB", "1.0 MB", "12.3 MB", "1.23 GB", "5.00 TB"]  # fmt: skip


# -- device_map ----------------------------------------------------------------------------------------


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    one, two = a.state_dict(), b.state_dict()
    assert one.keys() == two.keys()
    for name in one:
        assert one[name].dtype == two[name].dtype and one[name].device == two[name].device, name
        assert torch.equal(one[name], two[name]), name


@pytest.mark.parametrize(
    ("device_map", "device"),
    [("cpu", "cpu"), ({"": "cpu"}, "cpu"), (torch.device("cpu"), "cpu"), ("auto", None), ("sequential", None)],
    ids=["cpu", "dict", "torch.device", "auto", "sequential"],
)
def test_device_map_naming_one_device_loads_as_device_does(llama: Path, device_map: object, device: str | None) -> None:
    """device_map="auto" on a machine with at most one GPU: where `device` defaults (its GPU, else its CPU)."""
    if torch.cuda.device_count() > 1 and device is None:
        pytest.skip("several GPUs: device_map='auto' is refused")
    reference = streamload.from_pretrained(llama, device=device)
    _same(streamload.from_pretrained(llama, device_map=device_map), reference)  # type: ignore[arg-type]
    _same(streamload.from_pretrained(llama, device=reference.device, device_map=device_map), reference)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device_map", "says"),
    [
        ({"model.embed_tokens": "cpu", "model.layers": 0, "model.norm": "cpu", "lm_head": "cpu"}, "cpu, cuda:0"),
        ({"": "disk"}, "offloads to disk"),
        ("disk", "offloads to disk"),
        ({"model": "cpu", "lm_head": "auto"}, "'auto' for a part"),
        ({}, "no device"),
    ],
    ids=["two-devices", "dict-disk", "disk", "auto-inside", "empty"],
)
def test_a_device_map_spreading_or_offloading_the_model_is_refused_naming_it(
    llama: Path, device_map: object, says: str
) -> None:
    with pytest.raises(ValueError, match="device_map=") as info:
        streamload.from_pretrained(llama, device_map=device_map)  # type: ignore[arg-type]
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_device_map_whose_keys_all_name_modules_on_one_device_loads(llama: Path) -> None:
    parts = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    _same(streamload.from_pretrained(llama, device_map=parts), streamload.from_pretrained(llama, device="cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("key", "hint"), [("model.layerz", "model.layers"), ("decoder", None)])
def test_a_device_map_naming_no_module_is_refused_before_any_weight_is_read(
    llama: Path, monkeypatch: pytest.MonkeyPatch, key: str, hint: str | None
) -> None:
    read: list[object] = []
    monkeypatch.setattr("streamload.integrations.transformers.fill", lambda *a, **k: read.append(a))
    with pytest.raises(ValueError, match=rf"device_map names '{key}', which is no module of LlamaForCausalLM") as info:
        streamload.from_pretrained(llama, device_map={"model.embed_tokens": "cpu", key: "cpu"})  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and str(llama) in message
    assert (f"did you mean {hint!r}" in message) if hint else "did you mean" not in message
    assert not read


def test_device_and_device_map_must_agree_and_name_devices(llama: Path) -> None:
    with pytest.raises(ValueError, match="name different devices"):
        streamload.from_pretrained(llama, device="cpu", device_map="cuda:0")
    with pytest.raises(TypeError, match=r"1\.5 is not a device"):
        streamload.from_pretrained(llama, device_map={"": 1.5})  # type: ignore[dict-item]


# -- trust_remote_code ---------------------------------------------------------------------------------

CONFIGURATION = """
open({marker!r}, "a").close()  # proves the folder's code ran
from transformers import LlamaConfig


class TinyConfig(LlamaConfig):
    model_type = "tiny-custom"
"""

MODELING = """
import torch
from transformers import LlamaForCausalLM

from .configuration_tiny import TinyConfig


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.logit_scale = torch.nn.Parameter(torch.ones(config.vocab_size))

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.logit_scale
        return out
"""


@pytest.fixture
def custom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder whose config's `auto_map` names its own config and model classes (a Llama with a scale on
    its logits), their files beside the weights. transformers copies such code into its modules cache and
    imports it from there: that cache is one under tmp_path, and the imports are forgotten after."""
    import transformers.dynamic_module_utils as dynamic
    from safetensors.torch import save_file

    folder = tmp_path / "tiny_custom"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "configuration_tiny.py").write_text(CONFIGURATION.format(marker=str(marker)))
    (folder / "modeling_tiny.py").write_text(MODELING)
    settings = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False).to_dict()
    settings |= {"model_type": "tiny-custom", "architectures": ["TinyForCausalLM"], "dtype": "float32",
                 "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig",
                              "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(settings))
    torch.manual_seed(0)
    weights = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)).state_dict()
    weights["logit_scale"] = torch.rand(SMALL["vocab_size"]) + 0.5
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", {"format": "pt"})

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    mapping = transformers.AutoModelForCausalLM._model_mapping
    monkeypatch.setattr(mapping, "_extra_content", dict(mapping._extra_content))
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]


def test_trust_remote_code_loads_the_folders_model_as_transformers_does(custom: Path) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(custom, trust_remote_code=True).eval()
    ours = streamload.from_pretrained(custom, device="cpu", trust_remote_code=True)
    assert type(ours).__name__ == type(reference).__name__ == "TinyForCausalLM"
    assert type(ours.config).__name__ == "TinyConfig" and not ours.training
    _same(ours, reference)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_without_trust_remote_code_the_folders_code_never_runs(custom: Path) -> None:
    with pytest.raises(streamload.UnsupportedError, match="trust_remote_code=True") as info:
        streamload.from_pretrained(custom, device="cpu")
    assert "config.json" in str(info.value) and "\n" not in str(info.value)
    assert not (custom.parent / "ran").exists()
    assert not (custom.parent / "modules").exists()


# -- dtype= as transformers takes it ------------------------------------------------------------------


def _config_dtype(folder: Path, dtype: str | None) -> None:
    """config.json's dtype set to `dtype`, or removed (None): its older name too."""
    config = json.loads((folder / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    if dtype is not None:
        config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("stored", "said"), [(torch.float32, "as saved"), (torch.bfloat16, None),
                                              (torch.float32, "float16")],
                         ids=["config", "weights", "config-over-weights"])  # fmt: skip
def test_dtype_auto_is_what_transformers_gives_bit_for_bit(
    tmp_path: Path, stored: torch.dtype, said: str | None
) -> None:
    """transformers' "auto": the config's dtype, else the first floating-point tensor's of the weights."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False))
    model.to(stored).save_pretrained(tmp_path)
    if said != "as saved":
        _config_dtype(tmp_path, said)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype="auto", device_map="cpu")
    ours = streamload.from_pretrained(tmp_path, device="cpu", dtype="auto")
    _same(ours, theirs)
    assert ours.model.embed_tokens.weight.dtype == (torch.float16 if said == "float16" else stored)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.complex64, "float8_e4m3fn"]
)
def test_a_dtype_no_model_is_built_in_is_refused_saying_which_are(llama: Path, dtype: object) -> None:
    with pytest.raises(ValueError, match="dtype=") as info:
        streamload.from_pretrained(llama, device="cpu", dtype=dtype)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and "torch.bfloat16" in message and "'auto'" in message, message
