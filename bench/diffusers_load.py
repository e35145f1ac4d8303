"""streamload against diffusers' own `from_pretrained` on a diffusion pipeline folder, cold and warm, a
fresh process per run, loaders taking turns (medians reported, with ratios to diffusers' default).

    python bench/diffusers_load.py --make /tmp/sd-bench      # once: a ~1.3 GB fp16 UNet + VAE + CLIP pipeline
    python bench/diffusers_load.py /tmp/sd-bench --runs 5

Loaders: diffusers (its default), diffusers with HF_ENABLE_PARALLEL_LOADING=yes, streamload. The time is
the `from_pretrained` call, in the run's process (diffusers and transformers imported before), to a
pipeline ready on the CPU; then with a byte of every weight page touched (the mapped views a loader
hands out are read from storage only then: the first inference pays for what the load left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOADERS = {
    "diffusers": {},
    "diffusers-parallel": {"HF_ENABLE_PARALLEL_LOADING": "yes"},
    "streamload": {},
}


def make(folder: Path) -> None:
    import torch
    import transformers
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from testbed.diffusers_pipelines import clip_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=768,
                                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))  # fmt: skip
    blocks = {"down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}
    vae = AutoencoderKL(block_out_channels=[128, 256, 512, 512], latent_channels=4, **blocks)
    clip = transformers.CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12)  # fmt: skip
    text = transformers.CLIPTextModel(clip)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=clip_tokenizer(folder / "_tok"), unet=unet,
                                   scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)  # fmt: skip
    pipe.to(torch.float16).save_pretrained(folder)
    size = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    print(f"wrote {folder}: {size / 1e9:.2f} GB")


def one(loader: str, folder: str) -> None:
    import torch
    import transformers  # noqa: F401
    from diffusers import DiffusionPipeline  # imported outside the clock for every loader alike

    if loader == "streamload":
        import streamload

        load = lambda: streamload.from_pretrained(folder, device="cpu", dtype=torch.float16)  # noqa: E731
    else:
        load = lambda: DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float16)  # noqa: E731
    start = time.perf_counter()
    pipe = load()
    seconds = time.perf_counter() - start
    # A loader may hand out views of file mappings whose pages are read only when first used: touching
    # a byte of every page makes every loader's weights resident, as the first inference would.
    params = [p for c in pipe.components.values() if isinstance(c, torch.nn.Module) for p in c.parameters()]
    for p in params:
        raw = p.detach().reshape(-1).view(torch.uint8)
        raw[::4096].sum()
    resident = time.perf_counter() - start
    print("RESULT " + json.dumps({"seconds": seconds, "resident": resident}), flush=True)


def run(loader: str, folder: Path, cold: bool) -> dict[str, float]:
    from streamload.commands.bench import evict, parallel_read

    files = [str(f) for f in folder.rglob("*.safetensors")]
    if cold:
        evict(files)
    else:
        parallel_read(files, direct=False, pinned=False)()
    env = {**os.environ, **LOADERS[loader]}
    done = subprocess.run([sys.executable, __file__, "--one", loader, str(folder)], capture_output=True, text=True,
                          env=env, check=False)  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"{loader} failed:\n{done.stderr[-2000:]}")
    return json.loads(line[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?")
    parser.add_argument("--make", type=Path, help="write the benchmark pipeline here and exit")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", default="cold,warm")
    args = parser.parse_args()
    if args.make:
        return make(args.make)
    if args.one:
        return one(args.one, str(args.folder))
    if args.folder is None:
        parser.error("give a pipeline folder (make one with --make)")
    from streamload.commands.bench import compile_streamload

    compile_streamload()  # as installed: no run compiles our modules
    times: dict[str, dict[str, list[dict[str, float]]]] = {m: {n: [] for n in LOADERS} for m in args.modes.split(",")}
    for i in range(args.runs):
        for mode, by_loader in times.items():
            for name in LOADERS:
                by_loader[name].append(run(name, args.folder, cold=mode == "cold"))
                r = by_loader[name][-1]
                print(f"run {i + 1} {mode:4} {name:18} {r['seconds']:.3f} s, resident {r['resident']:.3f} s")
    print("\n| mode | loader | from_pretrained (s) | x diffusers | + every page touched (s) | x diffusers |")
    print("|---|---|---|---|---|---|")
    for mode, by_loader in times.items():
        base = {k: statistics.median(r[k] for r in by_loader["diffusers"]) for k in ("seconds", "resident")}
        for name, runs in by_loader.items():
            load, resident = (statistics.median(r[k] for r in runs) for k in ("seconds", "resident"))
            print(
                f"| {mode} | {name} | {load:.3f} | {load / base['seconds']:.2f}x | {resident:.3f} | "
                f"{resident / base['resident']:.2f}x |"
            )


if __name__ == "__main__":
    main()
