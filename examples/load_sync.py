"""Load a checkpoint into a state dict from plain code, converting floating-point weights to fp16.

python examples/load_sync.py path/to/model
"""

from __future__ import annotations

import sys

import torch

import streamload

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(
            f"usage: python {sys.argv[0]} PATH (a checkpoint's file, folder or index, or an s3:// or https:// URL)",
            file=sys.stderr,
        )
        sys.exit(2)
    ckpt = streamload.inspect(sys.argv[1])
    print(f"{len(ckpt.files)} files, {len(ckpt.tensors)} tensors, {ckpt.nbytes / 1e9:.2f} GB, metadata {ckpt.metadata}")
    state = streamload.load(sys.argv[1], device="cpu", dtype=torch.float16, exclude="*rotary_emb.inv_freq")
    print(f"loaded {len(state)} tensors")
