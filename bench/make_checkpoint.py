"""Write the benchmark checkpoint: llama-shaped, bf16, 2.11 GB in 4 shards (or --layers for other sizes).

python bench/make_checkpoint.py /tmp/streamload-bench
streamload bench /tmp/streamload-bench --cold --warm --runs 5 --plot docs/bench-cpu.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from streamload.commands.demo import Shape, write_checkpoint

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--layers", type=int, default=18, help="18 layers: 2.11 GB; each layer adds 104 MB")
    ap.add_argument("--shards", type=int, default=4)
    args = ap.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    shape = Shape(vocab=32000, hidden=2048, intermediate=5632, layers=args.layers)
    write_checkpoint(args.directory, shape, args.shards)
