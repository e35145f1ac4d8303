"""`streamload inspect` names a checkpoint's quantization in one line: checkpoints synthesized in each
format's real layout (the names, dtypes and shapes its writers use, and its `quantization_config`)."""

from __future__ import annotations

import ctypes
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import streamload
from streamload.commands.cli import main
from streamload.quant.identify import describe

from .conftest import same_bits, write_raw


def raw(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    return bytes(torch.zeros(shape, dtype=dtype).view(-1).view(torch.uint8).numpy())


def checkpoint(folder: Path, tensors: dict[str, tuple[str, list[int], bytes]], quantization: dict | None) -> Path:
    folder.mkdir()
    write_raw(folder / "model.safetensors", tensors)
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def norms(n: int = 2) -> dict[str, tuple[str, list[int], bytes]]:
    return {f"model.layers.{i}.input_layernorm.weight": ("BF16", [256], raw(torch.bfloat16, (256,))) for i in range(n)}


def fp8_block(folder: Path) -> Path:  # DeepSeek-V3 / Qwen3-FP8: F8_E4M3 weights, a float32 scale per 128x128 block
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        tensors[p + "weight"] = ("F8_E4M3", [256, 256], raw(torch.float8_e4m3fn, (256, 256)))
        tensors[p + "weight_scale_inv"] = ("F32", [2, 2], raw(torch.float32, (2, 2)))
    return checkpoint(folder, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "fmt": "e4m3", "weight_block_size": [128, 128]})  # fmt: skip


def compressed_w4a16(folder: Path) -> Path:  # compressed-tensors pack-quantized: eight int4 in an int32
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        tensors[p + "weight_packed"] = ("I32", [256, 32], raw(torch.int32, (256, 32)))
        tensors[p + "weight_scale"] = ("BF16", [256, 2], raw(torch.bfloat16, (256, 2)))
        tensors[p + "weight_shape"] = ("I64", [2], raw(torch.int64, (2,)))
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 128}}  # fmt: skip
    return checkpoint(folder, tensors, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                        "config_groups": {"group_0": scheme}})  # fmt: skip


def gptq(folder: Path) -> Path:  # GPTQ: qweight/qzeros int32, scales float16, g_idx
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj."
        tensors[p + "qweight"] = ("I32", [32, 256], raw(torch.int32, (32, 256)))
        tensors[p + "qzeros"] = ("I32", [2, 32], raw(torch.int32, (2, 32)))
        tensors[p + "scales"] = ("F16", [2, 256], raw(torch.float16, (2, 256)))
        tensors[p + "g_idx"] = ("I32", [256], raw(torch.int32, (256,)))
    return checkpoint(folder, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})


def mxfp4(folder: Path) -> Path:  # gpt-oss: experts' weights as 4-bit blocks of 32 with a shared exponent
    tensors = norms()
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        tensors[p + "gate_up_proj_blocks"] = ("U8", [4, 512, 8, 16], raw(torch.uint8, (4, 512, 8, 16)))
        tensors[p + "gate_up_proj_scales"] = ("U8", [4, 512, 8], raw(torch.uint8, (4, 512, 8)))
        tensors[p + "gate_up_proj_bias"] = ("BF16", [4, 512], raw(torch.bfloat16, (4, 512)))
    return checkpoint(
        folder, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    )


def fp8_without_config(folder: Path) -> Path:
    path = fp8_block(folder)
    (path / "config.json").unlink()
    return path


CASES = {
    "fp8-block": (
        fp8_block,
        "quantization: fp8 (8-bit, blocks of 128x128); 2 quantized weights stored as F8_E4M3; "
        "2 scale tensors: *.weight_scale_inv",
    ),
    "compressed-tensors-w4a16": (
        compressed_w4a16,
        "quantization: compressed-tensors pack-quantized int (4-bit, "
        "groups of 128); 2 quantized weights stored as I32; 2 scale tensors: *.weight_scale",
    ),
    "gptq": (
        gptq,
        "quantization: gptq (4-bit, groups of 128); 2 quantized weights stored as I32; 6 scale "
        "tensors: *.g_idx, *.qzeros, *.scales",
    ),
    "mxfp4": (
        mxfp4,
        "quantization: mxfp4 (4-bit, blocks of 32); 2 quantized weights stored as U8; 2 scale tensors: *_scales",
    ),
    "fp8-no-config": (
        fp8_without_config,
        "quantization: float8 weights (8-bit); 2 quantized weights stored as "
        "F8_E4M3; 2 scale tensors: *.weight_scale_inv",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_inspect_names_the_quantization_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, line = CASES[case]
    folder = make(tmp_path / case)
    assert main(["inspect", str(folder)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert line in printed, printed
    assert main(["inspect", "--json", str(folder)]) == 0
    shown = json.loads(capsys.readouterr().out)["quantization"]
    assert shown == json.loads(json.dumps(describe(streamload.inspect(folder))._asdict()))


def test_plain_weights_show_no_quantization(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A plain model may hold a tensor named like a scale (`layer_scales`, `.scales`): no weight beside it.
    tensors = norms() | {"model.layer_scales": ("F32", [4], raw(torch.float32, (4,))),
                         "model.norm.scales": ("F32", [4], raw(torch.float32, (4,)))}  # fmt: skip
    folder = checkpoint(tmp_path / "plain", tensors, None)
    assert describe(streamload.inspect(folder)) is None
    assert main(["inspect", str(folder)]) == 0
    assert "quantization" not in capsys.readouterr().out


# -- FP8 with block scales through from_pretrained, dequantized as transformers does here -------------------


def same_as_theirs(theirs: torch.nn.Module, ours: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """transformers' own model and streamload's: the same names, every tensor bit for bit (dtypes
    included), the same logits; their state dicts, for what a test checks more."""
    want, got = theirs.state_dict(), ours.state_dict()
    assert set(want) == set(got)
    assert [n for n in want if not same_bits(want[n], got[n])] == []
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)
    return want, got


def fp8_model(folder: Path, build: Any, config: Any, block: int = 128, kept: tuple[str, ...] = ()) -> Path:
    """A transformers model's checkpoint with every linear weight of its layers quantized as DeepSeek-V3's
    FP8 checkpoints are: float8_e4m3fn values, a float32 `weight_scale_inv` per `block` x `block`; the
    config names the modules `kept` unquantized (its `modules_to_not_convert`)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    build(config).to(torch.bfloat16).save_pretrained(folder)
    saved = {n: t for f in sorted(folder.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    tensors: dict[str, torch.Tensor] = {}  # as the hub has them (save_pretrained's names: experts one by one)
    for name, w in saved.items():
        if ".layers." in name and name.endswith("proj.weight") and w.dim() == 2:
            rows, cols = w.shape
            blocks = w.float().reshape(rows // block, block, cols // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            tensors[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = scale
        else:
            tensors[name] = w.contiguous()
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_file = json.loads((folder / "config.json").read_text())
    config_file["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                          "weight_block_size": [block, block]}  # fmt: skip
    if kept:
        config_file["quantization_config"]["modules_to_not_convert"] = list(kept)
    (folder / "config.json").write_text(json.dumps(config_file))
    return folder


def llama_fp8(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
    config = transformers.LlamaConfig(**sizes, tie_word_embeddings=False, dtype="bfloat16")
    return fp8_model(folder, transformers.LlamaForCausalLM, config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers dequantizes FP8 only without a GPU (or when told)")
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_an_fp8_block_checkpoint_loads_as_transformers_dequantizes_it(
    tmp_path: Path, dtype: torch.dtype | None
) -> None:
    """transformers' own from_pretrained, on a machine without a GPU, dequantizes FP8 weights (each value
    times its block's scale, in float32) into a plain model: streamload computes the same as each layer's
    weights and scales arrive — every tensor bit for bit, the same logits."""
    transformers = pytest.importorskip("transformers")
    folder = llama_fp8(tmp_path / "fp8")
    kwargs = {} if dtype is None else {"dtype": dtype}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    ours = streamload.from_pretrained(folder, device="cpu", **kwargs)
    want, _ = same_as_theirs(theirs, ours)
    assert want["model.layers.0.mlp.down_proj.weight"].dtype == (dtype or torch.bfloat16)


def test_an_fp8_scale_grid_that_does_not_divide_its_weight_is_named_before_reading(tmp_path: Path) -> None:
    folder = llama_fp8(tmp_path / "fp8")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 2)  # 512 rows are not 3 blocks
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if torch.cuda.is_available():
        pytest.skip("transformers keeps FP8 layers on this GPU: refused as quantized")
    said = (r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' \[512, 256\] is not divided into whole "
            r"blocks by its scale .*\[3, 2\]; nothing was read")  # fmt: skip
    with pytest.raises(streamload.StreamloadError, match=said):
        streamload.from_pretrained(folder, device="cpu")


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_float8_value_times_any_scale_is_transformers_own_product(
    stored: torch.dtype, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float8 values are widened by their bits (through float16, which holds each exactly: the
    vectorized conversion), not by torch's float8 one, which bounded a load's time: every one of the 256
    values times scales from subnormal to where the shortcut steps aside gives transformers' formula's
    bits (float32 product, cast once), NaN included."""
    from streamload.quant import dequantize
    from streamload.quant.dequantize import fp8_blocks

    monkeypatch.setattr(dequantize, "_CHUNK", 128 * 256)  # a block row at a time: two chunks here
    rows = torch.stack([torch.arange(256, dtype=torch.uint8).roll(i) for i in range(256)])  # each value in each column
    every = rows.view(stored)  # 65,536 values: enough for the shortcut
    finite = rows.masked_fill(every.float().isnan(), 0).view(stored)  # no NaN: the shortcut taken
    scales = [2.0**-149, 1e-40, 2.0**-126, 1e-3, 0.7, 1.0, 3.3e5, 2.0**99, 2.0**125, 0.0, -2.5, float("inf")]
    for weight in (every, finite, every[:2, :128]):  # and few values: torch's own conversion
        for value in scales:
            scale = torch.tensor([[value, -value], [value / 3, 1.0]])[: len(weight) // 128 or 1]  # 128x128 blocks
            blocks = weight.to(torch.float32).view(len(scale), -1, 2, 64 if len(weight) == 2 else 128)
            want = (blocks * scale.view(len(scale), 1, 2, 1)).view(weight.shape).to(dtype)
            assert same_bits(fp8_blocks(weight, scale, dtype), want), (stored, dtype, value)


def test_stacked_fp8_matrices_take_one_scale_grid_or_one_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts stacked [E, rows, cols] with one scale, one block grid for all, or one grid each: each
    block times its own scale, over several chunks, as the broadcast product gives it."""
    from streamload.quant import dequantize
    from streamload.quant.dequantize import fp8_blocks

    monkeypatch.setattr(dequantize, "_CHUNK", 128 * 512)  # a block row at a time
    weight = (torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(0)) * 50).to(torch.float8_e4m3fn)
    for scale in (torch.tensor(0.3), torch.rand(2, 4) + 0.5, torch.rand(4, 2, 4) + 0.5):
        grid = scale.reshape(-1, 2, 4) if scale.dim() else scale.reshape(1, 1, 1)
        rows, cols = grid.shape[-2:]
        blocks = weight.to(torch.float32).view(-1, rows, 256 // rows, cols, 512 // cols)
        want = (blocks * grid[:, :, None, :, None]).view(weight.shape).to(torch.bfloat16)
        assert same_bits(fp8_blocks(weight, scale, torch.bfloat16), want), tuple(scale.shape)
    shaped = types.SimpleNamespace  # a header's shape is all the check reads
    said = dequantize._fp8_grid(shaped(shape=[4, 256, 512]), shaped(shape=[2, 2, 4]))  # 2 grids for 4 matrices
    assert said == "is not given one block grid, or one a matrix, by its scale"


def _in_process(t: torch.Tensor) -> list[bool]:
    """For each page `t` touches: whether the process has it mapped (the present bit of /proc/self/pagemap)."""
    first, last = t.data_ptr() // 4096, (t.data_ptr() + t.nbytes - 1) // 4096
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return [bool(int.from_bytes(entries[i : i + 8], "little") >> 63) for i in range(0, len(entries), 8)]


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads the process's page table")
def test_released_tensors_file_pages_leave_the_process_and_nothing_else_does(tmp_path: Path) -> None:
    """Once a tensor viewing a file mapping is used up (a quantized part computed, a tensor copied out),
    its pages leave the process (the mapped reader's views kept the whole checkpoint's pages resident to
    the end: 1.59x of the model's bytes, docs/benchmarks.md); a page it shares with a neighbour goes once
    the neighbour is released too, never while the neighbour is in use; memory no file maps stays."""
    from streamload.base.page_release import Release

    data = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB
    (tmp_path / "f").write_bytes(data.numpy().tobytes())
    mapping = torch.UntypedStorage.from_file(str(tmp_path / "f"), shared=False, nbytes=data.numel() * 4)
    whole = torch.empty(0, dtype=torch.int32).set_(mapping)
    # Pages one at a time: a file's huge pages mapped whole would leave the process whole (harmless: a
    # page read again is the file's), which would hide what is asserted here.
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(whole.data_ptr(), whole.nbytes, 15) == 0  # MADV_NOHUGEPAGE
    cuts = (1000, (1 << 20) + 1000, (2 << 20) + 1000)  # three tensors side by side, each pair sharing a page
    a, b, c = whole[cuts[0] : cuts[1]], whole[cuts[1] : cuts[2]], whole[cuts[2] :]
    assert torch.equal(whole, data)  # every page now in the process
    release = Release()
    release(a)
    assert _in_process(a) == [True] + [False] * (len(_in_process(a)) - 2) + [True]  # its ends: shared pages
    release(b)  # joins a's run: the page they share goes now; the one b shares with c (in use) stays
    assert _in_process(a)[1:] == [False] * (len(_in_process(a)) - 1)
    assert _in_process(b) == [False] * (len(_in_process(b)) - 1) + [True]
    assert _in_process(c) == [True] * len(_in_process(c))
    assert torch.equal(whole, data)  # pages read again are the file's

    heap = data.clone()
    release(heap[1000:])  # not a file's: left as it is
    assert all(_in_process(heap)) and torch.equal(heap, data)


def _mapped_bytes(path: Path) -> int:
    """The bytes of `path`'s mappings the process holds (/proc/self/smaps)."""
    held, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            current = fields[-1] == str(path)
        elif current and fields[0] == "Rss:":
            held += int(fields[1]) * 1024
    return held


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the process's mappings")
@pytest.mark.parametrize("in_place", [False, True])
def test_a_load_into_a_module_holds_about_a_layers_file_pages_not_the_files(tmp_path: Path, in_place: bool) -> None:
    """A tensor copied out of the mapped reader's file mapping (into a parameter: `in_place`, or moved to
    an aligned address) gives its pages back at once: while layer 1 loads, layer 0's 8 MiB are no longer
    the process's (they were until the file's mapping closed: a peak of the model plus its checkpoint)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sizes = {"a": 3, "w": 2 << 20}
    tensors = {f"layers.{i}.{n}": torch.randn(size, generator=g) for i in range(2) for n, size in sizes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))  # "a" first: "w" is at an address no CPU kernel wants
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.a, layer.w = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2 << 20))
    held: dict[str, int] = {}

    def on_layer(key: str, module: torch.nn.Module) -> None:
        held[key] = _mapped_bytes((tmp_path / "model.safetensors").resolve())

    streamload.load_into(model, tmp_path, in_place=in_place, reader="mmap", device="cpu", on_layer=on_layer)
    assert held["layers.0"] < 1 << 20, held  # was 8 MiB and more
    for name, t in model.state_dict().items():
        assert same_bits(t, tensors[name]), name


def test_tensors_the_caller_gives_to_be_written_keep_what_was_written(tmp_path: Path) -> None:
    """`into=` tensors of the caller's that view a private file mapping (another load's, mapped) are
    written where they are: the model gets aligned copies of them, and their written pages stay theirs
    (given back, they would show their file's old bytes again)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    old = {"a": torch.randn(3, generator=g), "w": torch.randn(3 << 20, generator=g)}
    new = {n: torch.randn(t.shape, generator=g) for n, t in old.items()}
    save_file(old, str(tmp_path / "old.safetensors"))  # "a" first: "w" is at an address no CPU kernel wants
    (tmp_path / "new").mkdir()
    save_file(new, str(tmp_path / "new" / "model.safetensors"))
    theirs = streamload.load(tmp_path / "old.safetensors", device="cpu", reader="mmap")  # views of a mapping
    assert theirs["w"].data_ptr() % 64
    model = torch.nn.Module()
    model.a, model.w = (torch.nn.Parameter(torch.zeros(t.shape)) for t in old.values())
    streamload.load_into(model, tmp_path / "new", into=theirs, reader="mmap", device="cpu")
    for name, t in new.items():
        assert same_bits(theirs[name], t), name
        assert same_bits(model.state_dict()[name], t), name


def test_fp8_experts_merged_into_fused_tensors_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """transformers 5 dequantizes each FP8 expert (Qwen2-MoE's layout here, block scales) and stacks the
    experts into fused tensors (gate and up concatenated): streamload computes each expert's weight as it
    arrives with its scale and copies it into its region of the fused parameter: every tensor bit for
    bit, the same logits."""
    transformers = pytest.importorskip("transformers")
    sizes = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
             "shared_expert_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300}  # fmt: skip
    folder = fp8_model(
        tmp_path / "moe", transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(**sizes), block=32
    )
    if torch.cuda.is_available():
        pytest.skip("transformers keeps FP8 layers on this GPU")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = streamload.from_pretrained(folder, device="cpu")
    want, _ = same_as_theirs(theirs, ours)
    fused = [n for n in want if n.endswith("experts.gate_up_proj")]
    assert fused and want[fused[0]].dim() == 3 and want[fused[0]].dtype == torch.bfloat16


@pytest.fixture
def fp8_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' checks answered as on a GPU of compute capability 9.0 (H100), where it keeps FP8 as
    stored: the layout of the load is theirs; nothing runs on a GPU (the forward pass would)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize("model", ["llama", "qwen2-moe"])
def test_fp8_is_placed_as_stored_with_its_scales_where_transformers_keeps_it(
    tmp_path: Path, fp8_kernels: None, model: str
) -> None:
    """Where transformers has FP8 kernels (a GPU of compute capability 8.9 or more) it keeps the float8
    weights and their block scales in its FP8 layers, the experts' stacked as their weights are:
    streamload reads each into the same parameter (it refused them before): every tensor bit for bit,
    float8 where theirs is."""
    transformers = pytest.importorskip("transformers")
    if model == "llama":
        folder = llama_fp8(tmp_path / "fp8")
    else:
        sizes = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
                 "shared_expert_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300}  # fmt: skip
        config = transformers.Qwen2MoeConfig(**sizes)
        kept = ("shared_expert_gate", "lm_head")  # [1, hidden]: not in blocks, so left plain
        folder = fp8_model(tmp_path / "moe", transformers.Qwen2MoeForCausalLM, config, block=32, kept=kept)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = streamload.from_pretrained(folder, device="cpu")
    want, got = theirs.state_dict(), ours.state_dict()
    assert set(want) == set(got)
    assert [n for n in want if not same_bits(want[n], got[n])] == []
    kept = [n for n, t in got.items() if t.dtype == torch.float8_e4m3fn]
    assert kept and all(n.removesuffix(".weight") + ".weight_scale_inv" in got or n + "_scale_inv" in got for n in kept)
    if model != "llama":
        assert any(n.endswith("experts.gate_up_proj") and got[n].dim() == 3 for n in kept)


COMPRESSED = ["w8a8-int8", "w8a8-int8-tensor", "fp8-channel", "w4a16-group", "w4a16-channel", "w4a8"]


@pytest.mark.parametrize("layout", COMPRESSED)
def test_a_compressed_tensors_checkpoint_loads_as_transformers_places_it(tmp_path: Path, layout: str) -> None:
    """compressed-tensors (int8 and FP8 by channel or tensor, 4-bit packed by group or channel, W4A8):
    transformers' own quantizer lays the model out for the stored tensors (packed weights, scales,
    shapes) and its loader puts them in as stored; streamload reads each straight into the same
    parameters: every tensor bit for bit, the same logits (decompressed on the first forward pass)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from testbed.quantized_layouts import make

    from .vllm_engines import SMALL

    folder = make(tmp_path, SMALL, [layout])[layout]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = streamload.from_pretrained(folder, device="cpu")
    _, got = same_as_theirs(theirs, ours)
    quantized = {n: t.dtype for n, t in got.items() if n.startswith("model.layers.0.mlp.down_proj.")}
    assert len(quantized) >= 2 and any(not d.is_floating_point or d.itemsize == 1 for d in quantized.values())


@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_gptq_and_awq_are_refused_before_reading_naming_the_method(tmp_path: Path, layout: str) -> None:
    """transformers loads GPTQ and AWQ through optimum and gptqmodel (not installed with streamload's
    extras): refused in one line naming the quantization, before a byte is read."""
    pytest.importorskip("transformers")
    from testbed.quantized_layouts import make

    from .vllm_engines import SMALL

    folder = make(tmp_path, SMALL, [layout])[layout]
    with pytest.raises(streamload.StreamloadError, match=rf"quant_method is '{layout}'.*nothing was read"):
        streamload.from_pretrained(folder, device="cpu")


def compressed_moe(tmp_path: Path, layout: str) -> Path:
    """A Qwen2-MoE checkpoint quantized by compressed-tensors (`layout`), the experts one by one as the
    hub stores them, the routers' gates left unquantized as llm-compressor's MoE recipes leave them."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file, save_file

    from testbed.quantized_layouts import CONFIGS, quantized

    sizes = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
             "shared_expert_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300}  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**sizes)).save_pretrained(tmp_path / "plain")
    tensors: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(tmp_path / "plain" / "model.safetensors")).items():
        is_linear = ".layers." in name and name.endswith("proj.weight") and w.dim() == 2
        tensors |= quantized(name, w.float(), layout) if is_linear else {name: w.contiguous()}
    folder = tmp_path / f"{layout}-moe"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    quantization = CONFIGS[layout] | {
        "ignore": [*CONFIGS[layout]["ignore"], "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
    }
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    return folder


@pytest.mark.parametrize("layout", ["w4a16-group", "fp8-channel"])
def test_a_compressed_tensors_mixture_of_experts_loads_as_transformers_decompresses_it(
    tmp_path: Path, layout: str
) -> None:
    """transformers 5 decompresses compressed-tensors experts (packed 4-bit, FP8) before merging them
    into fused tensors (its DecompressExperts conversion; in the scale's dtype, and FP8 in bfloat16
    whatever the model's before 5.21, in the model's from then on) and keeps every other layer as
    stored: streamload decompresses each expert with transformers' own operation as its parts arrive,
    into its region of the fused parameter, and places the rest as stored — every tensor bit for bit
    (dtypes included), the same logits."""
    transformers = pytest.importorskip("transformers")
    folder = compressed_moe(tmp_path, layout)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = streamload.from_pretrained(folder, device="cpu")
    want, _ = same_as_theirs(theirs, ours)
    assert want["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 256, 128)
    from streamload.integrations.transformers_internals import version

    fp8_as_model = layout == "fp8-channel" and version(transformers) >= (5, 21)
    fused = want["model.layers.1.mlp.experts.gate_up_proj"].dtype
    assert fused == (torch.float32 if fp8_as_model else torch.bfloat16)  # the model's is float32
    assert any(n.startswith("model.layers.1.self_attn.q_proj.weight_") for n in want)  # kept as stored


def test_int8_compressed_tensors_experts_are_refused_before_reading(tmp_path: Path) -> None:
    """int8 experts (compressed-tensors `int-quantized`: no packed weights) are not what transformers'
    DecompressExperts reads (its own loader fails on them too): refused in one line naming it."""
    folder = compressed_moe(tmp_path, "w8a8-int8")
    said = (r"qwen2_moe: transformers converts '.*experts.*' with (DecompressExperts|CompressedTensorsDequantize)"
            r".*nothing was read")  # its name from 5.21 on  # fmt: skip
    with pytest.raises(streamload.StreamloadError, match=said):
        streamload.from_pretrained(folder, device="cpu")


# -- MXFP4 (gpt-oss) through from_pretrained, dequantized as transformers does without its kernels ---------


def gpt_oss_mxfp4(folder: Path) -> Path:
    """A gpt-oss checkpoint as OpenAI ships it: the experts' fused weights as MXFP4 (`*_blocks`: uint8
    [experts, out, in / 32, 16], two 4-bit floats a byte; `*_scales`: uint8 [experts, out, in / 32], a
    power-of-two exponent per 32 values), everything else bfloat16."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    sizes = {"hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
             "vocab_size": 300, "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**sizes, dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(folder)
    random = torch.Generator().manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows_in, cols_out = w.shape
            tensors[name + "_blocks"] = torch.randint(0, 256, (experts, cols_out, rows_in // 32, 16), generator=random,
                                                      dtype=torch.uint8)  # fmt: skip
            tensors[name + "_scales"] = torch.randint(118, 131, (experts, cols_out, rows_in // 32), generator=random,
                                                      dtype=torch.uint8)  # fmt: skip
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers may keep MXFP4 on a GPU with its kernels")
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_an_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tmp_path: Path, dtype: torch.dtype | None) -> None:
    """transformers' own from_pretrained, without its MXFP4 kernels (always on the CPU), dequantizes
    gpt-oss's experts into bfloat16 (even in a float32 model; from 5.23 on, into the model's dtype) in
    the experts' layout: streamload computes the same as each layer's blocks and exponents arrive —
    every tensor bit for bit (dtypes included), the same logits."""
    transformers = pytest.importorskip("transformers")
    folder = gpt_oss_mxfp4(tmp_path / "gpt-oss")
    kwargs = {} if dtype is None else {"dtype": dtype}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    ours = streamload.from_pretrained(folder, device="cpu", **kwargs)
    want, _ = same_as_theirs(theirs, ours)
    assert want["model.layers.1.mlp.experts.down_proj"].shape == (4, 64, 128)
    from streamload.integrations.transformers_internals import in_parameter_dtype
    from streamload.quant.methods import METHODS

    # gpt-oss's dequantized experts: each value from the FP4 table in that dtype, then `ldexp`
    experts = (dtype or torch.bfloat16) if in_parameter_dtype(METHODS["mxfp4"]) else torch.bfloat16
    assert want["model.layers.1.mlp.experts.down_proj"].dtype == experts
    assert want["model.layers.1.mlp.router.weight"].dtype == (dtype or torch.bfloat16)


def test_mxfp4_blocks_whose_exponents_do_not_match_are_named_before_reading(tmp_path: Path) -> None:
    folder = gpt_oss_mxfp4(tmp_path / "gpt-oss")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj_scales"] = torch.zeros(4, 128, 3, dtype=torch.uint8)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    said = (
        r"model.safetensors: tensor 'model.layers.1.mlp.experts.down_proj_blocks' \[4, 128, 2, 16\] is not "
        r"\[experts, out, groups, bytes\] with one exponent per group in its scale .*\[4, 128, 3\]; nothing was "
        "read"
    )
    with pytest.raises(streamload.StreamloadError, match=said):
        streamload.from_pretrained(folder, device="cpu")
