"""A diffusion pipeline loaded by streamload and by diffusers: the same weights, the same image.

Builds a small Stable Diffusion pipeline (UNet + VAE + CLIP text encoder, random weights) from
configs into a folder, or takes yours, then loads it with `streamload.from_pretrained` and with
diffusers' `DiffusionPipeline.from_pretrained` and compares one seeded image.

    pip install -e ".[diffusers]"
    python examples/diffusers_pipeline.py                   # a small pipeline, made in a temporary folder
    python examples/diffusers_pipeline.py path/to/pipeline  # a pipeline folder of yours (model_index.json)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

import streamload


def image(pipe: DiffusionPipeline, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe("a red cat", num_inference_steps=2, generator=generator, height=size, width=size,
                output_type="pt").images  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?", help="a pipeline folder (default: make a small one)")
    parser.add_argument("--size", type=int, default=32, help="image height and width (default: 32)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder
        if folder is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from testbed.diffusers_pipelines import stable_diffusion

            folder = stable_diffusion(Path(scratch) / "pipeline")
        start = time.perf_counter()
        ours = streamload.from_pretrained(folder, device="cpu")
        print(f"streamload: {type(ours).__name__} in {time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        theirs = DiffusionPipeline.from_pretrained(folder)
        print(f"diffusers:  {type(theirs).__name__} in {time.perf_counter() - start:.2f} s")
        same = torch.equal(image(ours, args.size), image(theirs, args.size))
        print("the same image for the same seed" if same else "the images differ")
        raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
