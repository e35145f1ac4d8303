"""`streamload demo`: write a small llama-shaped checkpoint, stream it to the best device, show the numbers.
With the mmap reader (the CPU's default) the tensors are views of the mapped files: no byte is copied while
they are handed out, so the demo says so and times a touch of every page of them instead of a copy rate."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

import streamload
from streamload.base.errors import StreamloadError
from streamload.plan.layer_keys import layer_of


@dataclass(frozen=True)
class Shape:
    vocab: int = 32000
    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 12


def llama_tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    h, i = shape.hidden, shape.intermediate
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        names |= {p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"}
        names |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)}
        names |= {p + "mlp.down_proj.weight": (h, i)}
        names |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    names |= {"model.norm.weight": (h,), "lm_head.weight": (shape.vocab, h)}
    return names


def write_checkpoint(directory: Path, shape: Shape = Shape(), shards: int = 2) -> Path:
    """Write random bf16 weights as `shards` files plus a `model.safetensors.index.json`, as HF does."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    specs = list(llama_tensors(shape).items())
    per = -(-len(specs) // shards)
    umask = os.umask(0)
    os.umask(umask)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        part = specs[k * per : (k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in part}, directory / fname)
        os.chmod(directory / fname, 0o666 & ~umask)  # save_file makes 0600 files; the index gets the umask
        weight_map |= {n: fname for n, _ in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json")


def _reason(exc: Exception) -> str:
    # safetensors' own error (its writer is Rust) carries the OS's reason in its text
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _make_folder(directory: Path) -> None:
    """`directory`, made if need be; a one-line error naming it where it cannot be (`--keep` given a file,
    a read-only or unwritable place)."""
    if directory.exists() and not directory.is_dir():
        raise StreamloadError(f"{directory}: exists and is not a directory: give --keep a folder (new or existing)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StreamloadError(f"{directory}: cannot create the folder: {_reason(exc)}") from None
    if not os.access(directory, os.W_OK):  # read-only mounts refuse root too; say so before the slow part
        raise StreamloadError(f"{directory}: cannot write the demo checkpoint there: not writable")


def run(device: str | None = None, cold: bool = True, keep: Path | None = None) -> None:
    from rich.console import Console

    from streamload.base.progress import progress_bar
    from streamload.commands.bench import evict, touch

    console = Console()
    with tempfile.TemporaryDirectory(prefix="streamload-demo-") as tmp:
        directory = keep or Path(tmp)
        _make_folder(directory)
        with console.status("writing a synthetic llama-shaped checkpoint (bf16, 2 shards)..."):
            try:
                write_checkpoint(directory)
            except (OSError, SafetensorError) as exc:  # a full disk, a read-only folder: no half-written shards
                for name in _NAMES:
                    (directory / name).unlink(missing_ok=True)
                raise StreamloadError(f"{directory}: cannot write the demo checkpoint there: {_reason(exc)}") from None
        files = sorted(directory.glob("*.safetensors"))
        if cold:
            evict(str(f) for f in files)
        stream = streamload.iter(directory, device=device)
        layer0 = {name for name in stream.checkpoint.tensors if (layer := layer_of(name)) and layer.index == 0}
        first_layer: float | None = None
        mapped: list[torch.Tensor] = []  # the mmap reader's views, touched after the stream
        with progress_bar(console=console) as progress:
            task = progress.add_task("streaming", total=stream.stats.bytes_total, stats=stream.stats)
            with stream:
                for name, tensor in stream:
                    if stream.stats.reader == "mmap":
                        mapped.append(tensor)
                    if name in layer0:
                        layer0.discard(name)
                        if not layer0:
                            first_layer = stream.stats.elapsed
                    progress.update(task, completed=stream.stats.bytes_read)
        s = stream.stats
        where = directory if keep else "a temporary directory"
        console.print(f"[bold]{where}[/bold]: {len(files)} files, {'cold' if cold else 'warm'} page cache")
        if mapped:
            # what a first use pays for bytes that were mapped, not copied (page faults, and reads where the
            # page cache lacks them)
            began = time.perf_counter()
            for t in mapped:
                touch(t)
            touched = time.perf_counter() - began
            how = (f"mapped into {s.device} via {s.reader} in {s.elapsed:.2f} s: the tensors view the page cache, "
                   f"nothing was copied; touching every page of them took {touched:.2f} s = "
                   f"[bold]{s.bytes_read / 1e9 / max(touched, 1e-9):.2f} GB/s[/bold]")  # fmt: skip
        else:
            how = f"to {s.device} via {s.reader} in {s.elapsed:.2f} s = [bold]{s.gbps:.2f} GB/s[/bold]"
        console.print(f"{s.tensors_done} tensors, {s.bytes_read / 1e9:.2f} GB {how}")
        console.print(
            f"first tensor after {1e3 * (s.time_to_first_tensor or 0):.1f} ms, "
            f"first full layer after {1e3 * (first_layer or 0):.1f} ms"
        )
