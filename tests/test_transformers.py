"""Real transformers architectures, saved with `save_pretrained`, loaded by `streamload.from_pretrained`:
outputs identical to `transformers`' own `from_pretrained`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import streamload

from .conftest import in_torch_layout

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128}  # fmt: skip
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)),
    "qwen2-tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL)),
    "gpt2-tied": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128)
    ),
    "bert": lambda: transformers.BertModel(
        transformers.BertConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            vocab_size=300,
            max_position_embeddings=128,
        )
    ),
    "t5-tied": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=64, d_ff=96, d_kv=16, num_layers=2, num_heads=4, vocab_size=300)
    ),
}


def _outputs(model: nn.Module, name: str) -> torch.Tensor:
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if name.startswith("t5"):
            return model(input_ids=ids, decoder_input_ids=ids[:, :5]).logits
        out = model(input_ids=ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_matches_transformers(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    original = MODELS[name]()
    original.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    reference = type(original).from_pretrained(tmp_path).eval()
    layers: list[str] = []
    ours = streamload.from_pretrained(tmp_path, device="cpu", on_layer=lambda key, module: layers.append(key))
    assert type(ours) is type(original) and not ours.training
    assert not [n for n, t in [*ours.named_parameters(), *ours.named_buffers()] if t.is_meta]
    assert_placed_alike(ours, reference)
    assert torch.equal(_outputs(ours, name), _outputs(reference, name))
    assert layers  # layers were handed out as they completed
    if name.endswith("-tied"):
        emb, head = ours.get_input_embeddings().weight, ours.get_output_embeddings().weight
        assert emb is head  # still one parameter


def assert_placed_alike(ours: nn.Module, reference: nn.Module) -> None:
    """Each weight at the address, modulo 64, transformers' own loader gives it (CPU kernels pick their
    summation order by the operands' alignment)."""
    theirs = dict(reference.state_dict(keep_vars=True))
    apart = [n for n, t in ours.state_dict(keep_vars=True).items() if t.data_ptr() % 64 != theirs[n].data_ptr() % 64]
    assert not apart, f"placed unlike transformers' own: {apart[:5]}"


def _tensors_8_bytes_past_64(folder: Path) -> None:
    """Rewrite the folder's weight file with its header padded so every tensor sits at 8 modulo 64 (safetensors
    aligns to 8 only; checkpoints written by other tools often sit so)."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, body = data[8 : 8 + n].rstrip(b" "), data[8 + n :]
    header += b" " * ((8 - (8 + len(header))) % 64)
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)


def test_from_pretrained_places_weights_as_transformers_does(tmp_path: Path) -> None:
    """Tensors stored 8 bytes past 64-byte alignment: the weights stay the file mapping's views where transformers
    keeps them so (a 64-byte-aligned copy of each cost a 90 MB model 0.3 s, 10x transformers' whole load), and a
    one-token forward, whose one-row linears sum by the weight's alignment, equals transformers' own bit for bit."""
    torch.manual_seed(0)
    MODELS["bert"]().save_pretrained(tmp_path)
    _tensors_8_bytes_past_64(tmp_path)
    reference = transformers.BertModel.from_pretrained(tmp_path).eval()
    ours = streamload.from_pretrained(tmp_path, device="cpu")
    assert_placed_alike(ours, reference)
    with torch.no_grad():
        for n in range(1, 4):
            ids = torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(n))
            assert torch.equal(ours(input_ids=ids).last_hidden_state, reference(input_ids=ids).last_hidden_state)


def test_a_converted_checkpoint_missing_an_expert_fails_before_reading(tmp_path: Path) -> None:
    """transformers 5 stores Mixtral's experts one by one and fuses them when it loads (tests/test_convert.py);
    with one expert gone, the fused parameter would have a hole: the load stops before reading anything."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    ).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    gone = next(n for n in state if ".experts.2.w1." in n)
    del state[gone]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        streamload.UnsupportedError,
        match=r"mixtral: 'model.layers.0.mlp.experts.gate_up_proj': .*\[3, 96, 64\], \[4, 96, 64\]",
    ):
        streamload.from_pretrained(tmp_path, device="cpu")


def test_from_pretrained_converts_dtype(tmp_path: Path) -> None:
    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path)
    ours = streamload.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert torch.equal(_outputs(ours, "llama"), _outputs(in_torch_layout(reference), "llama"))


def test_a_missing_key_is_an_error_before_any_weight_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    batches = []
    monkeypatch.setattr(streamload.pipeline.pipeline.Pipeline, "next_batch", lambda self: batches.append(1))
    missing = r"missing keys: 'model.layers.1.mlp.up_proj.weight'; nothing was read.*strict=False does not help"
    with pytest.raises(streamload.StreamloadError, match=missing):
        streamload.from_pretrained(tmp_path, device="cpu")
    assert batches == []


@pytest.fixture
def edited_llama(tmp_path: Path) -> Callable[[str, Callable[[dict[str, torch.Tensor]], object]], Path]:
    """A small llama saved by transformers; `edited_llama(name, edit)` copies it to `name` with `edit`
    applied to its weights."""
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
def test_a_quantized_checkpoint_is_named_and_strict_false_is_not_offered(edited_llama: Callable, strict: bool) -> None:
    folder = edited_llama("gptq", _gptq)
    with pytest.raises(streamload.UnsupportedError) as caught:
        streamload.from_pretrained(folder, device="cpu", strict=strict)
    text = str(caught.value)
    assert "the checkpoint is quantized (it holds 'model.layers.0.mlp.down_proj.qweight'" in text, text
    assert "with strict=False it would load wrong values or none" in text and "nothing was read" in text
    assert "missing keys: 'model.layers.0.mlp.down_proj.weight'" in text
    assert "pass strict=False" not in text


@pytest.mark.parametrize("strict", [True, False])
def test_a_missing_parameter_says_strict_false_does_not_help(edited_llama: Callable, strict: bool) -> None:
    """strict=False is not offered where it cannot help: the parameter would stay on the meta device, and
    torch would fail later ('Cannot copy out of meta tensor')."""
    folder = edited_llama("missing", lambda state: state.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(streamload.StreamloadError) as caught:
        streamload.from_pretrained(folder, device="cpu", strict=strict)
    text = str(caught.value)
    assert text.startswith("loading into LlamaForCausalLM: missing keys: 'model.layers.1.mlp.up_proj.weight'; "
                           "nothing was read."), text  # fmt: skip
    assert "strict=False does not help: the model's 'model.layers.1.mlp.up_proj.weight' would have no values" in text
    assert "pass strict=False" not in text


def test_an_unexpected_key_offers_strict_false_which_then_loads(edited_llama: Callable, tmp_path: Path) -> None:
    folder = edited_llama("extra", lambda state: state.update({"model.layers.1.mlp.extra": torch.ones(2)}))
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


def test_from_pretrained_names_the_config_field_a_shape_came_from(tmp_path: Path) -> None:
    """A config.json whose intermediate_size disagrees with the weights: refused before reading (as
    transformers refuses without ignore_mismatched_sizes), naming tensor, both shapes and the field."""
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
    with pytest.raises(
        streamload.StreamloadError, match=rf"{tmp_path}/config.json: transformers cannot read this config"
    ):
        streamload.from_pretrained(tmp_path, device="cpu")


def test_from_pretrained_takes_torch_dtype_as_transformers_does_and_refuses_an_unknown_option_first(
    tmp_path: Path,
) -> None:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = streamload.from_pretrained(tmp_path, device="cpu", torch_dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with pytest.raises(ValueError, match="give dtype= or torch_dtype= .*not both"):
        streamload.from_pretrained(tmp_path, device="cpu", dtype=torch.float16, torch_dtype=torch.float16)
    with pytest.raises(TypeError, match="from_pretrained\\(\\) got unexpected keyword arguments: low_cpu_mem_usage"):
        streamload.from_pretrained(tmp_path, device="cpu", low_cpu_mem_usage=True)


def test_empty_weights_makes_buffers_for_real_and_parameters_on_meta() -> None:
    before = torch.nn.init.kaiming_uniform_
    with streamload.empty_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
        assert torch.nn.init.kaiming_uniform_ is not before
    assert torch.nn.init.kaiming_uniform_ is before and nn.Module.register_parameter.__name__ == "register_parameter"
    assert all(p.is_meta for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq
    assert not inv_freq.is_meta and torch.equal(
        inv_freq, transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).model.rotary_emb.inv_freq
    )
    assert nn.Linear(3, 4).weight.device.type == "cpu"  # and nothing leaks out of the block


def _example(name: str) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["overlapped", "sequential"])
def test_first_token_example_warms_up_what_generate_runs(tmp_path: Path, mode: str) -> None:
    """The cold-start example compiles each decoder layer with the inputs of generate's first pass:
    every layer is compiled during the load (or after it), and generate then compiles nothing more
    and gives the token that plain transformers gives. (The eager backend: dynamo's tracing and
    guards are real, inductor's code generation is left out to keep the test fast.)"""
    torch.manual_seed(0)
    # More layers than dynamo's recompile limit (8): each layer's graph is its own (the KV cache guards on
    # the layer's entry), and every one must be compiled, not only the first 8.
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 10}, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="100KB")
    example = _example("first_token")
    reference = example.run(str(tmp_path), "transformers", torch.device("cpu"))  # type: ignore[attr-defined]
    ours = example.run(str(tmp_path), mode, torch.device("cpu"), backend="eager")  # type: ignore[attr-defined]
    assert ours["graphs"] >= 10  # one per decoder layer, all before generate
    assert ours["compiled_in_generate"] == 0
    assert ours["token"] == reference["token"]
    assert ours["imported"] <= ours["weights"] <= ours["compiled"] <= ours["first_token"]


def test_the_transformers_example_loads_the_folder_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    MODELS["bert"]().save_pretrained(tmp_path)
    _example("transformers_model").main(["transformers_model.py", str(tmp_path)])  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert f"{tmp_path}: BertModel" in out
    assert "weights identical: True, outputs (last_hidden_state) identical: True" in out


def test_a_folder_from_pretrained_cannot_build_from_is_one_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    MODELS["bert"]().save_pretrained(tmp_path / "bert")
    weights = tmp_path / "bert" / "model.safetensors"
    (tmp_path / "bare").mkdir()
    weights.rename(tmp_path / "bare" / "model.safetensors")
    cases = {
        tmp_path / "bare": "no config.json (nor model_index.json)",
        tmp_path / "bare" / "model.safetensors": "a file, not a model's folder",
    }
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"hidden_size": 3}')
    cases[tmp_path / "odd"] = "config.json: transformers cannot read this config: Unrecognized model"
    for path, says in cases.items():
        with pytest.raises(streamload.StreamloadError) as caught:
            streamload.from_pretrained(path, device="cpu")
        assert str(caught.value).startswith(str(path)) and says in str(caught.value)
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("release", ["4.57.6", "5.18.0", "6.0.0", "6.1.0.dev0"])
def test_a_transformers_release_outside_the_tested_range_is_refused_in_one_line_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    """streamload calls transformers' conversion and quantizer internals (through one adapter), which
    change between releases: a release before the oldest tested or of another major version is refused
    in one line naming the tested range, before a byte of the weights is read."""
    from streamload.integrations import transformers_internals as internals

    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(tmp_path)
    import transformers  # now: transformers replaces its module in sys.modules when it first loads a class

    batches = []
    monkeypatch.setattr(streamload.pipeline.pipeline.Pipeline, "next_batch", lambda self: batches.append(1))
    monkeypatch.setattr(transformers, "__version__", release)
    low, high = (f"{v[0]}.{v[1]}" for v in (internals.LOWEST, internals.HIGHEST))
    said = rf"tested with transformers {low} to {high} .*this is transformers {release}.*nothing was read"
    with pytest.raises(streamload.UnsupportedError, match=said) as caught:
        streamload.from_pretrained(tmp_path, device="cpu")
    assert "\n" not in str(caught.value) and batches == []


def test_the_adapter_takes_the_releases_in_its_range() -> None:
    from types import SimpleNamespace

    from streamload.integrations.transformers_internals import check_version, version

    assert version(SimpleNamespace(__version__="5.25.0.dev0")) == (5, 25)
    for release in ("5.19.0", "5.24.0", "5.30.1"):  # later releases of the tested major are taken
        check_version(SimpleNamespace(__version__=release))
