"""`streamload.offload`: a model several times its budget runs with its blocks streamed in: outputs
identical to the model loaded whole, memory bounded (counted and measured), errors leave nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import streamload

transformers = pytest.importorskip("transformers")

CONFIG = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 12, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("offload")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(out, max_shard_size="3MB")
    return out


def empty_model() -> torch.nn.Module:
    with streamload.empty_weights():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
MASK = torch.ones_like(IDS)


@pytest.mark.parametrize(("ahead", "share"), [(0, 1 / 3), (1, 1 / 3), (3, 0.6)])
def test_outputs_identical_to_the_whole_model(llama: Path, ahead: int, share: float) -> None:
    whole = streamload.from_pretrained(llama, device="cpu")
    with torch.no_grad():
        want_logits = whole(IDS).logits
        want_tokens = whole.generate(IDS, attention_mask=MASK, max_new_tokens=4, do_sample=False)
    total = streamload.inspect(llama).nbytes
    model = empty_model()
    budget = int(total * share)
    with streamload.offload(model, llama, device="cpu", budget_bytes=budget, ahead=ahead, reader="posix") as off:
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, want_logits)
            got = model.generate(IDS, attention_mask=MASK, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, want_tokens)
        stats = off.stats
    assert stats.offloaded_blocks >= 4
    # 5 passes (a forward, 4 generated tokens), each fetching every streamed block once (layer 10
    # sorts before layer 2 in the files: fetched in the order the forward runs them, not the files')
    assert 5 * stats.offloaded_blocks <= stats.fetches <= 5 * stats.offloaded_blocks + ahead
    assert stats.peak_bytes <= stats.budget_bytes
    assert stats.peak_bytes <= stats.resident_bytes + (ahead + 1) * stats.block_bytes
    assert all(p.is_meta for layer in model.model.layers[-4:] for p in layer.parameters())  # dropped at close


def test_blocks_that_fit_stay_resident(llama: Path) -> None:
    total = streamload.inspect(llama).nbytes
    model = empty_model()
    with streamload.offload(model, llama, device="cpu", budget_bytes=total * 3 // 4) as off:
        assert 0 < off.stats.resident_blocks < 12 and off.stats.offloaded_blocks == 12 - off.stats.resident_blocks
        assert not any(p.is_meta for p in model.model.layers[0].parameters())
        with torch.no_grad():
            model(IDS)


def test_a_budget_too_small_is_refused_before_reading(llama: Path) -> None:
    model = empty_model()
    with pytest.raises(streamload.StreamloadError, match=r"a budget of 1000 bytes cannot hold .* needs at least \d+"):
        streamload.offload(model, llama, device="cpu", budget_bytes=1000)
    assert all(p.is_meta for p in model.parameters())  # nothing was read


def test_an_error_mid_forward_leaves_no_fetch_and_no_block(llama: Path) -> None:
    total = streamload.inspect(llama).nbytes
    model = empty_model()

    def fail(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError("layer 5 fell over")

    hook = model.model.layers[5].register_forward_pre_hook(fail)
    with streamload.offload(model, llama, device="cpu", budget_bytes=total // 2, ahead=2, reader="posix") as off:
        with pytest.raises(RuntimeError, match="fell over"), torch.no_grad():
            model(IDS)
        assert not off._fetching and not off._streams
        assert off._held == off.resident_bytes
        assert all(p.is_meta for b in off.blocks for p in b.module.parameters())
        hook.remove()
        whole = streamload.from_pretrained(llama, device="cpu")
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, whole(IDS).logits)  # and it runs again


def test_offload_refuses_what_it_decides_itself(llama: Path) -> None:
    with pytest.raises(streamload.UnsupportedError, match="include"):
        streamload.offload(empty_model(), llama, device="cpu", budget_bytes=1 << 30, include="*")
    with pytest.raises(streamload.UnsupportedError, match="host_cache"):
        streamload.offload(empty_model(), llama, device="cpu", budget_bytes=1 << 30, host_cache=True)


CHILD = r"""
import json, sys, torch, transformers, streamload
def rss():
    fields = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
config = transformers.LlamaConfig(**json.loads(sys.argv[2]))
with streamload.empty_weights():
    model = transformers.LlamaForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
budget = int(sys.argv[3])
with torch.no_grad():
    torch.nn.functional.linear(torch.ones(1, 8), torch.ones(8, 8))  # the allocator's first arenas
before = rss()
with streamload.offload(model, sys.argv[1], device="cpu", budget_bytes=budget, reader="posix",
                        ring_bytes=4 << 20, slots=2) as off:
    with torch.no_grad():
        for _ in range(2):
            model(ids)
    stats = off.stats
print(json.dumps({"before": before, "after": rss(), "peak_bytes": stats.peak_bytes, "fetches": stats.fetches}))
"""


def test_process_memory_stays_within_budget_and_ring(tmp_path: Path) -> None:
    """Measured, not counted: a 4x-budget model's forward raises the process's peak RSS by at most the
    budget, the ring and a margin for activations and the allocator."""
    config = {**CONFIG, "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
              "num_hidden_layers": 16, "num_key_value_heads": 4, "vocab_size": 1024}  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path, max_shard_size="8MB")
    total = streamload.inspect(tmp_path).nbytes
    budget = total // 4
    # A fixed mmap threshold: glibc otherwise raises it after the first large free and keeps freed
    # layers in its heap (10-25 MB of run-to-run noise in the peak); RSS then tracks live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(config), str(budget)],
                         capture_output=True, text=True, check=True, env=env)  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    grew = got["after"]["VmHWM"] - got["before"]["VmHWM"]
    assert got["fetches"] >= 2 * 14
    assert got["peak_bytes"] <= budget
    assert grew <= budget + (4 << 20) + (24 << 20), (grew, budget, total)
    assert total > 3 * budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host_cache", [False, True])
def test_cuda_offload_identical_and_bounded(llama: Path, host_cache: bool) -> None:
    whole = streamload.from_pretrained(llama, device="cuda:0")
    ids, mask = IDS.cuda(), MASK.cuda()
    with torch.no_grad():
        want = whole.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    del whole
    total = streamload.inspect(llama).nbytes
    model = empty_model()
    torch.cuda.synchronize()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    budget = total // 3
    with streamload.offload(model, llama, device="cuda:0", budget_bytes=budget, host_cache=host_cache) as off:
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert off.stats.peak_bytes <= budget
    assert torch.equal(got, want)
    ring = 8 << 20  # the posix/kvikio ring of a small checkpoint is at most its size
    assert torch.cuda.max_memory_allocated() - base <= budget + max(ring, total) + (64 << 20)
    # reserved, too: every fetch allocates on one loader stream, whose freed blocks the next one reuses
    assert torch.cuda.max_memory_reserved() - base_reserved <= budget + max(ring, total) + (64 << 20)


def test_each_streamed_block_is_waited_for_and_handed_to_the_compute_by_its_device_kind(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward's thread waits for a block's copies and ties each of its tensors to its own work
    (CUDA: the compute stream) through the device's kind, whatever the kind: a new accelerator's
    kind is asked as CUDA's is."""
    import threading

    from streamload.device import kinds
    from streamload.device.cpu import CPUKind

    calls: list[str] = []

    class Recording(CPUKind):
        def wait_ready(self, dev: torch.device, ready: object | None) -> None:
            if threading.current_thread() is threading.main_thread():
                calls.append("wait")

        def hand_off(self, t: torch.Tensor) -> None:
            if threading.current_thread() is threading.main_thread():  # not the fetches' own hand-off
                calls.append("hand_off")

    monkeypatch.setitem(kinds.KINDS, "cpu", Recording())
    model = empty_model()
    with streamload.offload(model, llama, device="cpu", budget_bytes=streamload.inspect(llama).nbytes // 3,
                            reader="posix") as off, torch.no_grad():  # fmt: skip
        calls.clear()  # the resident weights' load, in this thread, handed off its own tensors
        model(IDS)
        blocks = off.stats.offloaded_blocks
        tensors = sum(len(b.slots) for b in off.blocks)
    assert blocks >= 4
    assert calls.count("wait") == blocks and calls.count("hand_off") == tensors


def test_tied_embeddings_and_a_foreign_checkpoint(tmp_path: Path) -> None:
    """The names are checked as load_into checks them: a tied head needs no tensor of its own, and a
    checkpoint of another model is refused before anything is read."""
    config = transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": True})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    whole = streamload.from_pretrained(tmp_path / "tied", device="cpu")
    with streamload.empty_weights():
        model = transformers.LlamaForCausalLM(config).eval()
    budget = streamload.inspect(tmp_path / "tied").nbytes // 2
    with streamload.offload(model, tmp_path / "tied", device="cpu", budget_bytes=budget), torch.no_grad():
        assert torch.equal(model(IDS).logits, whole(IDS).logits)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4)).save_pretrained(
        tmp_path / "gpt2"
    )
    with pytest.raises(streamload.StreamloadError, match="missing keys: .*nothing was read"):
        streamload.offload(empty_model(), tmp_path / "gpt2", device="cpu", budget_bytes=1 << 30)


def test_a_model_built_on_meta_is_refused_naming_its_empty_buffers(llama: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(llama)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        streamload.StreamloadError, match=r"buffers 'model.rotary_emb.inv_freq'.*streamload.empty_weights\(\)"
    ):
        streamload.offload(model, llama, device="cpu", budget_bytes=1 << 30)


def test_mapped_blocks_are_kept_as_views_across_passes(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU, mapped reader: a streamed block is views of the kept file mappings (no memory of its own),
    so only the first pass streams it; outputs stay identical. Converted blocks are copies: streamed
    every pass, never kept."""
    from streamload.nn.offload import Offloaded

    whole = streamload.from_pretrained(llama, device="cpu")
    with torch.no_grad():
        want = whole.generate(IDS, attention_mask=MASK, max_new_tokens=4, do_sample=False)
    streams: list[int] = []
    stream = Offloaded._stream

    def counted(self: Offloaded, block: object, device: object) -> Iterator[tuple[str, torch.Tensor]]:
        yield from stream(self, block, device)  # type: ignore[arg-type]
        streams.append(1)  # counted once streamed whole: a prefetch the block's exit stopped is no fetch

    monkeypatch.setattr(Offloaded, "_stream", counted)
    budget = streamload.inspect(llama).nbytes // 3
    for dtype, kept in ((None, True), (torch.float16, False)):
        streams.clear()
        model = empty_model()
        with streamload.offload(model, llama, device="cpu", budget_bytes=budget, dtype=dtype) as off:
            with torch.no_grad():
                got = model.generate(IDS, attention_mask=MASK, max_new_tokens=4, do_sample=False)
            assert len(off._views) == (off.stats.offloaded_blocks if kept else 0)
        # read once the offload ended: a prefetch still in flight at the forward's end may finish its block (a
        # fetch, and a stream) before the exit stops the rest
        blocks, fetches = off.stats.offloaded_blocks, off.stats.fetches
        if dtype is None:
            assert torch.equal(got, want)
        assert len(streams) == (blocks if kept else fetches)
        assert fetches >= 4 * blocks
