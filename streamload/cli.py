"""The `streamload` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import StreamloadError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="write a small synthetic checkpoint and stream it, with numbers")
    demo.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    demo.add_argument("--warm", action="store_true", help="leave the files in the page cache (default: cold)")
    demo.add_argument("--keep", type=Path, default=None, help="write the checkpoint here and keep it")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run

            run(device=args.device, cold=not args.warm, keep=args.keep)
    except StreamloadError as exc:
        print(f"streamload: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
