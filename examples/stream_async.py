"""Stream a checkpoint in async code and start using layers as they arrive.

python examples/stream_async.py path/to/model
"""

from __future__ import annotations

import sys

import anyio

import streamload


async def main(path: str) -> None:
    async with streamload.iter(path, device="cpu") as stream:
        async for name, tensor in stream:
            layer = streamload.layer_of(name)
            where = f"layer {layer.index}" if layer else "outside the layers"
            print(f"{stream.stats.elapsed * 1e3:8.1f} ms  {name}  {tuple(tensor.shape)}  ({where})")
    s = stream.stats
    print(f"{s.tensors_done} tensors, {s.bytes_read / 1e9:.2f} GB in {s.elapsed:.2f} s via {s.reader}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(
            f"usage: python {sys.argv[0]} PATH (a checkpoint's file, folder or index, or an s3:// or https:// URL)",
            file=sys.stderr,
        )
        sys.exit(2)
    anyio.run(main, sys.argv[1])
