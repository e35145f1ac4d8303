"""streamload leaves the process as it found it: after any entry point, finished or failed, torch's
initialisers and `nn.Module` are torch's own, no module holds a function of streamload's, and
transformers' own loads behave as if streamload had never run."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import streamload

transformers = pytest.importorskip("transformers")

BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
        "vocab_size": 300, "max_position_embeddings": 128}  # fmt: skip


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    model.save_pretrained(folder)
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        torch.save({"state": model.state_dict(), "ids": ids, "out": model(input_ids=ids).last_hidden_state},
                   folder / "expected.pt")  # fmt: skip
    return folder


def _truncated(folder: Path, into: Path) -> Path:
    """A copy of the folder whose weights end halfway through: the load fails after it has started."""
    into.mkdir()
    for f in folder.iterdir():
        data = f.read_bytes()
        (into / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    return into


def _streamload_functions() -> Iterator[tuple[str, object]]:
    """Every function of streamload's that a module outside streamload holds, directly or in a dict."""
    for name, module in list(sys.modules.items()):
        if name.startswith(("streamload", "tests")) or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            values = value.values() if type(value) is dict else (value,)  # not lazy mappings
            for v in list(values):
                if isinstance(v, types.FunctionType) and (v.__module__ or "").startswith("streamload"):
                    yield f"{name}.{attr}", v


def _state() -> dict[str, object]:
    init = {n: getattr(torch.nn.init, n) for n in dir(torch.nn.init) if not n.startswith("__")}
    return {**init, "register_parameter": nn.Module.register_parameter, "threads": torch.get_num_threads(),
            "default_dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "collector": gc.isenabled()}  # fmt: skip


def _entry_points(bert: Path, tmp: Path) -> dict[str, Callable[[], object]]:
    broken = _truncated(bert, tmp / "broken")

    def empty_then_load_into() -> object:
        with streamload.empty_weights():
            model = transformers.BertModel(transformers.BertConfig(**BERT))
        return streamload.load_into(model, bert, device="cpu")

    return {
        "from_pretrained": lambda: streamload.from_pretrained(bert, device="cpu"),
        "from_pretrained failing mid-load": lambda: streamload.from_pretrained(broken, device="cpu"),
        "empty_weights + load_into": empty_then_load_into,
        "load_into failing mid-load": lambda: streamload.load_into(
            transformers.BertModel(transformers.BertConfig(**BERT)), broken, device="cpu"
        ),
        "load": lambda: streamload.load(bert, device="cpu"),
        "iter": lambda: list(streamload.iter(bert, device="cpu")),
        "inspect": lambda: streamload.inspect(bert),
    }


def test_every_entry_point_leaves_torch_and_modules_as_they_were(bert: Path, tmp_path: Path) -> None:
    before = _state()
    assert not list(_streamload_functions())
    for name, call in _entry_points(bert, tmp_path).items():
        try:
            call()
        except streamload.StreamloadError:
            assert "failing" in name, name
        else:
            assert "failing" not in name, name
        assert _state() == before, name
        assert not list(_streamload_functions()), name
    gc.disable()  # a caller that holds the collector off finds it off after a load
    try:
        streamload.load(bert, device="cpu")
        assert not gc.isenabled()
    finally:
        gc.enable()
    # and an error raised inside the block, while its patches are on
    with pytest.raises(RuntimeError, match="inside"), streamload.empty_weights():
        raise RuntimeError("inside")
    assert _state() == before


def test_initialisers_work_inside_empty_weights_on_real_tensors() -> None:
    """Only meta tensors skip initialisation: a buffer the constructor initialises is initialised."""
    with streamload.empty_weights():
        real = torch.empty(3)
        torch.nn.init.ones_(real)
        torch.nn.init.zeros_(torch.empty(2, device="meta"))
    assert torch.equal(real, torch.ones(3))


PROGRAM = """
import sys, torch, transformers, streamload
first, folder = sys.argv[1], sys.argv[2]
try:
    if first == "diffusers":
        streamload.from_pretrained(sys.argv[3], device="cpu")
    else:
        streamload.from_pretrained(folder if first == "whole" else sys.argv[3], device="cpu")
except streamload.StreamloadError as exc:
    print("failed as expected:", str(exc).splitlines()[0])
model = transformers.AutoModel.from_pretrained(folder).eval()
expected = torch.load(folder + "/expected.pt")
state = model.state_dict()
bad = [k for k, t in expected["state"].items() if not torch.equal(state[k], t)]
assert not bad, bad
with torch.no_grad():
    assert torch.equal(model(input_ids=expected["ids"]).last_hidden_state, expected["out"])
print("transformers' own load is right")
"""


@pytest.mark.parametrize("first", ["whole", "failing mid-load", "diffusers"])
def test_transformers_own_load_after_streamload_in_a_fresh_process(bert: Path, tmp_path: Path, first: str) -> None:
    """The new user's case: streamload first in a fresh process (transformers' initialisers module is
    imported during streamload's load), then transformers' own `from_pretrained` of the same model."""
    other = {"whole": bert, "failing mid-load": None, "diffusers": None}[first]
    if first == "failing mid-load":
        other = _truncated(bert, tmp_path / "broken")
    elif first == "diffusers":
        pytest.importorskip("diffusers")
        from testbed import diffusers_pipelines as made

        other = made.stable_diffusion(tmp_path / "sd")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PROGRAM), first, str(bert), str(other)],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "transformers' own load is right" in done.stdout
    assert ("failed as expected" in done.stdout) == (first == "failing mid-load")
