"""The `streamload` command: demo, inspect, digest, load, bench, serve, seed, vllm-check; `-v` shows what
streamload logs at INFO while it runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

from streamload.base.argument_checks import parse_size
from streamload.base.errors import StreamloadError
from streamload.integrations.startup import pinned_digests
from streamload.storage.base import redacted


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + traceback
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    from streamload import __version__

    parser = _Parser(prog="streamload", description="Stream safetensors checkpoints into CPU or GPU memory.")
    parser.add_argument("--version", action="version", version=f"streamload {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="also print what streamload logs at INFO "
                        "(the reader chosen, what peers served...) to stderr (default: warnings only)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_reading_commands, _bench_command, _serving_commands, _vllm_commands):  # in --help's order
        add(sub)
    return parser


def _reading_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """demo, inspect, digest, load: the commands that read a checkpoint and report."""
    device = "cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    demo = sub.add_parser("demo", help="write a small synthetic checkpoint and stream it, with numbers")
    demo.add_argument("--device", help=device)
    demo.add_argument("--warm", action="store_true", help="leave the files in the page cache (default: cold)")
    demo.add_argument("--keep", type=Path, help="write the checkpoint here and keep it "
                      "(default: a temporary directory, removed at the end)")  # fmt: skip
    inspect = sub.add_parser("inspect", help="describe a checkpoint from its headers alone")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON, every tensor listed (default: tables)")
    digest = sub.add_parser("digest", help="write streamload.digests.json for a checkpoint",
                            description="Hash every file of a checkpoint (BLAKE3 of each MiB of each tensor, "
                            "SHA-256 and MD5 of each file, and the version of the file it was read at) and "
                            "write streamload.digests.json next to it (a remote one: to --out, to publish "
                            "beside the objects), so that loads with verify=True check every tensor they "
                            "read, and peers and cache copies can be checked.")  # fmt: skip
    digest.add_argument("path", help="a file, directory or index, or an s3://, gs://, az://, abfs:// or http(s):// URL")
    digest.add_argument("--out", help="where to write the digest file (needed for a remote checkpoint)")
    load = sub.add_parser("load", help="load a checkpoint and report, with a progress bar")
    load.add_argument("path", help="a file, directory, index, or an s3://, gs://, az://, abfs:// or http(s):// URL")
    load.add_argument("--device", help=device)
    load.add_argument("--dtype", help="convert floating-point tensors to this floating-point dtype, "
                      "e.g. float16, bfloat16 (default: keep the stored dtypes)")  # fmt: skip
    load.add_argument(
        "--reader",
        default="auto",
        help="how the files are read: mmap (CPU: tensors view the mapped files, no copy), posix (parallel reads "
        "into staging memory), direct (as posix, bytes not in the page cache read with O_DIRECT), kvikio (CUDA: "
        "files straight into GPU memory), range (HTTP range requests, for s3://, gs://, az:// and http(s)://) "
        "(default: auto, the first that fits the source and device)",
    )
    load.add_argument("--cache-dir", help="keep a local copy of a remote checkpoint here, and read it next time "
                      "(default: none)")  # fmt: skip
    load.add_argument("--peers", action="extend", type=_commas, metavar="PEER",
                      help="a node seeding the objects (http://HOST:PORT, HOST[:PORT] or a name whose addresses are "
                      "the nodes; repeat, or commas, for several): read from first, each block checked against the "
                      "source's digests (docs/peers.md)")  # fmt: skip
    load.add_argument("--verify", action="store_true", help="check the bytes against known digests as they are "
                      "read (a Hugging Face cache's, or streamload.digests.json from `streamload digest`)")  # fmt: skip
    load.add_argument("--threads", type=_positive, help="reader threads (default: from the machine)")
    load.add_argument("--slots", type=_positive, help="ring slots (default: from the machine)")
    for flag, what in (("--chunk-bytes", "largest read request"), ("--ring-bytes", "staging ring size")):
        load.add_argument(flag, type=_size, metavar="SIZE",
                          help=f"{what}, in bytes or with a unit: 4MiB, 512KiB, 1GiB, 8M "
                          "(default: from the machine)")  # fmt: skip


def _bench_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    """bench: every installed loader timed on one checkpoint (bench.py)."""
    bench = sub.add_parser("bench", help="compare every installed loader on a checkpoint, in one run",
                           description="Compare every installed loader on a checkpoint, each run in a fresh "
                           "process. Defaults: a warm page cache, 5 runs, on the cpu.")  # fmt: skip
    bench.add_argument("path", nargs="?")
    bench.add_argument("--list", action="store_true", help="list the loaders, whether each runs here, and exit")
    bench.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    bench.add_argument("--cold", action="store_true",
                       help="evict the files from the page cache before each run (default: warm only)")  # fmt: skip
    bench.add_argument("--warm", action="store_true", help="with --cold: measure a warm cache too")
    bench.add_argument("--runs", type=_positive, help="runs per loader (default: 5; with --sweep: 3 per setting)")
    bench.add_argument("--loaders", nargs="+", help="names from `streamload.commands.bench.LOADERS` (default: every "
                       "one that runs here)")  # fmt: skip
    bench.add_argument("--json", type=Path, help="write rows and raw runs here (default: none)")
    bench.add_argument("--plot", type=Path, help="write the arrival-curve PNG here (default: none)")
    bench.add_argument("--markdown", type=Path, help="write the tables here (default: none)")
    bench.add_argument("--verify", action="store_true",
                       help="time streamload with and without verify=True (the digests known for the files) and "
                       "print each digest's speed on one core (default: off)")  # fmt: skip
    bench.add_argument("--drop", action="store_true",
                       help="drop each tensor once its pages are touched, as a server copying weights into its own "
                       "buffers does (default: keep all, as load_file's dict)")  # fmt: skip
    bench.add_argument("--sweep", action="store_true",
                       help="time streamload alone on a grid of threads x request size x ring around its defaults, "
                            "and print the best setting as options to pass")  # fmt: skip


def _serving_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """serve, seed, prefetch: fetching ahead of a server, and serving the copies to other nodes."""
    serve = sub.add_parser(
        "serve", help="start fetching a server's weights, then run the server (streamload serve -- vllm serve ...)",
        description="Start fetching the weights at once (object storage into a staging directory or "
        "--cache-dir, local files into the page cache), then run COMMAND with the fetch named in its "
        "environment: streamload's vLLM load format adopts it instead of starting its own after vLLM's "
        "imports. The weights' source is --source, else the command's --model-loader-extra-config "
        "'{\"source\": ...}', else its model when that is a path or URL. Exits with COMMAND's status.",
    )  # fmt: skip
    serve.add_argument("--source", help="the weights (default: from the command's arguments)")
    serve.add_argument("--cache-dir", type=Path, help="keep the download here (default: a "
                       "staging directory, removed once the engine has loaded and when the command ends)")  # fmt: skip
    serve.add_argument("--compile-cache", action="append", metavar="sha256:HEX",
                       help="fetch, first, the compiled-artifact archive of this digest published beside the "
                       "weights (it runs as code: only a pinned one is installed; repeat for several)")  # fmt: skip
    serve.add_argument("--peers", action="extend", type=_commas, metavar="PEER",
                       help="a node seeding the weights, fetched from first (as for `streamload load`; default: the "
                       "command's \"peers\" option)")  # fmt: skip
    serve.add_argument("--seed", metavar="[HOST:]PORT",
                       help="serve the complete copies in --cache-dir to other nodes' peers at this address, once the "
                       "fetch has ended, until the server exits (e.g. 8470; to peers that read each object from its "
                       "origin: see `streamload seed`)")  # fmt: skip
    serve.add_argument("--seed-token-file", type=Path, metavar="FILE",
                       help="--seed: the peers' token, the file's first line (default: STREAMLOAD_PEER_TOKEN_FILE, "
                       "STREAMLOAD_PEER_TOKEN)")  # fmt: skip
    serve.add_argument("--seed-cert", type=Path, metavar="PEM", help="--seed: serve TLS (https://) with this "
                       "certificate (chain)")  # fmt: skip
    serve.add_argument("--seed-key", type=Path, metavar="PEM", help="--seed: the certificate's key")
    serve.add_argument("server", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the server to run")
    seed = sub.add_parser("seed", help="serve the complete copies in a cache directory to peers over HTTP ranges",
                          description="Serve the complete copies a --cache-dir holds to other nodes' loads with "
                          "peers= (docs/peers.md), until stopped (SIGTERM, Ctrl-C); the first line printed names "
                          "the URL. Read-only; each request must prove it read the object from its origin (and, "
                          "with a token, that it holds the token); --cert/--key serve TLS.")  # fmt: skip
    seed.add_argument("--cache-dir", type=Path, required=True, help="the cache directory loads keep copies in")
    seed.add_argument("--host", default="0.0.0.0", help="the address to serve on (default: all)")  # nosec B104 # seeding serves other nodes
    seed.add_argument("--port", type=_port, help="the port (default: 8470; 0: any free one)")
    seed.add_argument("--rate", type=_rate, metavar="SIZE", help="the most bytes a second sent to "
                      "all peers together, with a unit: 50MB, 200MiB, 1GB (default: no cap)")  # fmt: skip
    seed.add_argument("--connections", type=_positive, default=32, help="connections at once (default: 32)")
    seed.add_argument("--token-file", type=Path, metavar="FILE", help="the peers' token, the file's "
                      "first line (default: STREAMLOAD_PEER_TOKEN_FILE, else STREAMLOAD_PEER_TOKEN; none: the proof "
                      "of reading the origin alone)")  # fmt: skip
    seed.add_argument("--cert", type=Path, metavar="PEM", help="serve TLS (https://) with this certificate "
                      "(chain), PEM")  # fmt: skip
    seed.add_argument("--key", type=Path, metavar="PEM", help="the certificate's private key, PEM "
                      "(default: in --cert's file)")  # fmt: skip
    ahead = sub.add_parser("prefetch", help="read a checkpoint ahead of its load: local files into the page cache, "
                           "object storage into --cache-dir")  # fmt: skip
    ahead.add_argument("source", help="a checkpoint directory, file, or s3://, gs://, az:// or http(s):// prefix")
    ahead.add_argument("--cache-dir", type=Path, help="where objects go (loads with it read them there)")
    ahead.add_argument("--threads", type=_positive, help="reads at once (default: as a load)")
    ahead.add_argument("--peers", action="extend", type=_commas, metavar="PEER", help="a node seeding the objects, "
                       "read from first (as for `streamload load`)")  # fmt: skip


def _vllm_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    """compile-cache, vllm-check: vLLM's compiled artifacts, and a check of its loads."""
    compiled = sub.add_parser(
        "compile-cache", help="publish vLLM's compiled artifacts beside a checkpoint, for nodes that start cold",
        description="Pack vLLM's torch.compile cache (VLLM_CACHE_ROOT, ~/.cache/vllm) into "
        "CHECKPOINT/streamload-compile-cache/<key>.tar, <key> naming this node's vLLM, torch and Python "
        "versions, CPU architecture and ISA (or GPU). A node starting with load_format='streamload' fetches "
        "the archive for its own key with the weights and installs what its cache lacks before vLLM compiles; "
        "copy or upload the folder with the checkpoint.",
    )  # fmt: skip
    compiled.add_argument("action", choices=["publish"])
    compiled.add_argument("checkpoint", type=Path, help="the local checkpoint directory to publish beside")
    compiled.add_argument("--cache-root", type=Path, help="vLLM's cache root (default: VLLM_CACHE_ROOT)")
    check = sub.add_parser("vllm-check", help="load a model through vLLM's default loader and through streamload, "
                           "and compare every parameter", description="Load MODEL twice in real vLLM engines, with "
                           "vLLM's default loader and with load_format='streamload', and compare every parameter "
                           "and buffer on every rank byte for byte right after load_weights (before vLLM "
                           "post-processes them). Exit status 0: identical; 1: the first differences are "
                           "printed.")  # fmt: skip
    check.add_argument("model", help="a local model directory or a hub id, as for `vllm serve`")
    check.add_argument("--tp", type=_positive, default=1, help="tensor-parallel ranks (default: 1)")
    check.add_argument("--dtype", default="auto", help="vLLM's --dtype (default: auto)")
    check.add_argument("--extra-config", type=json.loads, metavar="JSON",
                       help="streamload's model_loader_extra_config, e.g. '{\"cooperative\": true}'")  # fmt: skip
    check.add_argument("--engine", type=json.loads, metavar="JSON",
                       help="more vllm.LLM arguments, e.g. '{\"runner\": \"pooling\"}'")  # fmt: skip


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: said here, not as the socket's OverflowError."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range: a port is 0..65535 (0: any free one)")
    return value


SLOWEST_RATE = 1000  # bytes a second: under this a seeder's response outlasts any peer's wait


def _rate(text: str) -> int:
    """A rate cap in bytes a second, with its unit (`200MB`, `50MiB`): a bare `200` is refused, as the
    user who types it means megabytes far more often than 200 B/s, and so is anything under 1 KB/s."""
    value = _size(text)
    if text.strip().replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} has no unit: it would be {value} bytes a second; give one, "
                                         f"e.g. {text.strip()}MB (megabytes a second), {text.strip()}KiB")  # fmt: skip
    if value < SLOWEST_RATE:
        raise argparse.ArgumentTypeError(f"{text!r} is {value} bytes a second, under 1 KB/s: a MiB would take "
                                         f"{(1 << 20) / value / 60:.0f} minutes, past any peer's wait")  # fmt: skip
    return value


def _commas(text: str) -> list[str]:
    """One `--peers`: one peer, or several with commas (action="extend" joins them all in one list)."""
    return text.split(",")


def _size(text: str) -> int:
    """A byte count: `4194304`, `4MiB`, `4M` (binary), `4MB` (decimal), `1.5GiB`."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.verbose:
        return _run(args)
    # -v: the "streamload" logger's INFO lines (and warnings) on stderr while the command runs; the logger as
    # it was afterwards (main may run inside another program, or a test).
    logger = logging.getLogger("streamload")
    handler, level = logging.StreamHandler(sys.stderr), logger.level
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "demo":
            from streamload.commands.demo import run

            run(device=args.device, cold=not args.warm, keep=args.keep)
        elif args.command == "inspect":
            _inspect(args.path, as_json=args.json)
        elif args.command == "digest":
            _digest(args.path, args.out)
        elif args.command == "load":
            _load(args)
        elif args.command == "bench":
            return _bench(args)
        elif args.command == "vllm-check":
            return _vllm_check(args)
        elif args.command == "seed":
            from streamload.servers.seed import serve as seed

            seed(args.cache_dir, args.host, args.port, args.rate, args.connections, token_file=args.token_file,
                 cert=args.cert, key=args.key)  # fmt: skip
        elif args.command == "prefetch":
            _prefetch(args.source, args.cache_dir, args.threads, args.peers)
        elif args.command == "compile-cache":
            if not args.checkpoint.is_dir():  # publish makes its folder: a mistyped path would get one, silently
                raise StreamloadError(f"{args.checkpoint}: no such checkpoint directory (publish goes beside it)")
            try:
                from streamload.integrations.vllm.startup import compiled as compiled_cache
                from streamload.integrations.vllm.startup.recorded import recorded
            except ImportError as exc:
                raise StreamloadError(f"compile-cache needs vLLM: pip install -e '.[vllm]' ({exc})") from None
            archive = compiled_cache.publish(args.checkpoint, args.cache_root)  # FileNotFoundError: OSError below
            pin = pinned_digests.digest(archive.read_bytes())
            print(f"{pin}  {archive}")  # as sha256sum prints, the digest first
            if mine := recorded(args.checkpoint, args.cache_root):
                print(f"packed the compiled folder(s) its engines recorded for {args.checkpoint}: "
                      f"{', '.join(mine)}", file=sys.stderr)  # fmt: skip
            elif len(folders := compiled_cache.packed(args.cache_root)) > 1:
                print(f"packed {len(folders)} compiled folders ({', '.join(folders[:4])}"
                      f"{', ...' if len(folders) > 4 else ''}): no engine recorded which are this model's (a "
                      "run through --load-format streamload records its folder once compiled), so every "
                      "model compiled under this cache root went in; to publish this model's alone, run it "
                      "once through streamload, or with VLLM_CACHE_ROOT set to a folder of its own and then "
                      "publish with --cache-root that folder", file=sys.stderr)  # fmt: skip
            print(f"pin it where nodes load (it runs as code there): --model-loader-extra-config "
                  f"'{{\"compile_cache\": \"{pin}\"}}', or streamload serve --compile-cache {pin}",
                  file=sys.stderr)  # fmt: skip
        elif args.command == "serve":
            from streamload.commands.serve import serve

            command = args.server[1:] if args.server[:1] == ["--"] else args.server
            seeding = {"token_file": args.seed_token_file, "cert": args.seed_cert, "key": args.seed_key}
            if not args.seed and any(seeding.values()):
                raise ValueError("streamload serve: --seed-token-file, --seed-cert and --seed-key go with --seed")
            return serve(command, args.source, args.cache_dir, args.compile_cache, args.peers, args.seed,
                         seeding)  # fmt: skip
    except BrokenPipeError:  # `streamload inspect --json | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's own flush at exit stays quiet
        return 141
    except KeyboardInterrupt:  # torch still importing, or a stream closed on the way out: one line
        print("streamload: interrupted", file=sys.stderr)
        return 130
    # OSError: the machine's answer (a full disk, a read-only folder), one line naming the path
    except (StreamloadError, ValueError, OSError) as exc:
        print(f"streamload: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _prefetch(source: str, cache_dir: Path | None, threads: int | None, peers: list[str] | None = None) -> None:
    from streamload.integrations.startup.prefetch import fetch

    started = time.perf_counter()
    report = fetch(source, cache_dir, None, threads, peers)
    if not report["ok"]:
        raise StreamloadError(f"{redacted(source)}: {redacted(report['error'])}")
    where = f"{redacted(source)} into {cache_dir}" if cache_dir is not None else redacted(source)
    took = time.perf_counter() - started
    if "cached" not in report:  # local files (into the page cache), or objects read without a cache
        print(f"prefetched {where}: {report['bytes'] / 1e9:.2f} GB in {took:.1f} s")
        return
    # What the cache holds once the fetch has ended, not what was read: a copy another process writes
    # still, or one that could not be kept, is not there.
    missing = [redacted(m) for m in report["not_cached"]]
    print(f"prefetched {where}: {report['cached_bytes'] / 1e9:.2f} GB, {len(report['cached'])} file(s) complete "
          f"there, in {took:.1f} s")  # fmt: skip
    if missing:
        print(f"streamload: read but not kept in {cache_dir} (see the warnings above): {', '.join(missing)}",
              file=sys.stderr)  # fmt: skip


def _vllm_check(args: argparse.Namespace) -> int:
    model = Path(args.model).expanduser()
    if not model.exists() and (model.is_absolute() or args.model.startswith((".", "~")) or args.model.count("/") > 1):
        # a path, not a hub id: said now, not after vLLM's ~20 s of imports (check() says it for other callers)
        raise StreamloadError(f"{args.model}: no such directory")
    try:
        from streamload.integrations.vllm.check import check
    except ImportError as exc:
        raise StreamloadError(f"vllm-check needs vLLM: pip install -e '.[vllm]' ({exc})") from None
    engine = {"dtype": args.dtype, **(args.engine or {})}
    report = check(args.model, tp=args.tp, model_loader_extra_config=args.extra_config, **engine)
    print(report)
    return 0 if report.ok else 1


def _inspect(path: str, as_json: bool) -> None:
    from streamload.api import inspect
    from streamload.pipeline.verify import known_digests
    from streamload.plan.layer_keys import layer_of, layer_rank
    from streamload.quant.identify import describe

    ckpt = inspect(path)
    digests = known_digests(ckpt, strict=False)  # a broken digest file is shown, not raised
    tensors = list(ckpt.tensors.values())
    in_order = sorted(tensors, key=lambda t: (layer_rank(t.name), t.name))  # layers 0, 1, 2, ..., 10
    layer_names = {t.name: layer.name for t in in_order if (layer := layer_of(t.name))}
    layers = Counter(layer_names.values())
    rows = [{"name": t.name, "file": str(t.path), "dtype": t.dtype.name, "shape": list(t.shape),
             "byte_range": [t.begin, t.end], "layer": layer_names.get(t.name)} for t in in_order]  # fmt: skip
    dtypes = Counter(t.dtype.name for t in tensors)
    largest = max(tensors, key=lambda t: t.nbytes, default=None)
    quantization = describe(ckpt)
    summary = {
        "files": [
            {"path": str(f.path), "bytes": f.size, "tensors": len(f.tensors), "digest": _digest_row(digests[f.path])}
            for f in ckpt.files
        ],
        "tensor_count": len(tensors),
        "tensors": rows,
        "bytes": ckpt.nbytes,
        "layers": len(layers),
        "tensors_per_layer": dict(layers),
        "dtypes": {
            d: {"tensors": n, "bytes": sum(t.nbytes for t in tensors if t.dtype.name == d)} for d, n in dtypes.items()
        },
        "largest": None if largest is None else {"name": largest.name, "bytes": largest.nbytes},
        "metadata": ckpt.metadata,
        "quantization": None if quantization is None else quantization._asdict(),
    }
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    files = Table("file", "bytes", "tensors", "digests", title=redacted(path))
    for f in summary["files"]:
        files.add_row(Path(f["path"]).name, f"{f['bytes']:,}", str(f["tensors"]), _digest_text(f["digest"]))
    console.print(files)
    unknown = sum(1 for f in summary["files"] if not (f["digest"]["whole_file"] or f["digest"]["per_tensor"]))
    if unknown:
        console.print(f"no digest known for {_count(unknown, 'file')}: `streamload digest {redacted(path)}` "
                      "writes them (loads with verify=True check them)")  # fmt: skip
    kinds = Table("dtype", "tensors", "bytes")
    for d, v in summary["dtypes"].items():
        kinds.add_row(d, str(v["tensors"]), f"{v['bytes']:,}")
    console.print(kinds)
    per_layer = Counter(layers.values())
    shape = ", ".join(f"{_count(n, 'layer')} x {_count(k, 'tensor')}" for k, n in sorted(per_layer.items()))
    console.print(f"{_count(len(tensors), 'tensor')}, {ckpt.nbytes / 1e9:.3f} GB; {shape or 'no layers'}")
    if largest is not None:
        what = f"{largest.nbytes / 1e6:.1f} MB, {largest.dtype.name} {list(largest.shape)}"
        console.print(f"largest: {largest.name} ({what})")
    if quantization is not None:
        console.print(quantization.line(), markup=False, highlight=False, soft_wrap=True)
    if ckpt.metadata:
        console.print(f"metadata: {ckpt.metadata}")


def _digest_row(known: Any) -> dict[str, Any]:
    whole = known.whole
    return {
        "whole_file": None if whole is None else {"algorithm": whole.algorithm, "hex": whole.hex, "from": whole.origin},
        "per_tensor": None if known.blocks is None else {"block_bytes": known.block_bytes, "from": known.origin},
        "stale": known.stale,
    }


def _digest_text(row: dict[str, Any]) -> str:
    parts = ["per tensor"] if row["per_tensor"] else []
    if row["whole_file"]:
        origin = row["whole_file"]["from"]
        parts.append(row["whole_file"]["algorithm"] + (" (hub cache)" if "Hugging Face" in origin else ""))
    if row["stale"]:
        parts.append("unusable digest file")
    return " + ".join(parts) or "none"


def _digest(path: str, out: str | None) -> None:
    from streamload.api import inspect
    from streamload.pipeline.verify import write_digests

    started = time.perf_counter()
    ckpt = inspect(path)
    target, doc = write_digests(ckpt, out=None if out is None else Path(out))
    seconds = time.perf_counter() - started
    size = sum(f.size for f in ckpt.files)
    blocks = sum(len(b) for f in doc["files"].values() for b in f["tensors"].values())
    print(f"wrote {target}: {_count(len(ckpt.files), 'file')} (SHA-256 each), "
          f"{_count(len(ckpt.tensors), 'tensor')} in {_count(blocks, 'block')}; {size / 1e9:.2f} GB in "
          f"{seconds:.2f} s ({size / seconds / 1e9:.2f} GB/s)")  # fmt: skip


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _load(args: argparse.Namespace) -> None:
    from streamload.api import iter as stream_iter
    from streamload.base import progress
    from streamload.storage.peers import TALLY

    tuning = {k: v for k in ("threads", "chunk_bytes", "ring_bytes", "slots") if (v := getattr(args, k))}
    tallied, peers = TALLY.read(), args.peers
    # A dtype's name is resolved (and an unknown one refused) by the API, as for any caller.
    stream = stream_iter(args.path, device=args.device, dtype=args.dtype, reader=args.reader,
                         cache_dir=args.cache_dir, verify=args.verify, peers=peers, **tuning)  # fmt: skip
    s = stream.stats
    sizes = {i.name: i.nbytes for i in stream.plan.items}
    # The bar library loads draw, from the start (asked for); plain lines where none is drawn (a log, a pipe,
    # bars switched off, no tqdm): one per ~10% of the bytes handed out (reads run ahead of them).
    with progress.loading("loading", after=0.0) as bar, stream:
        if bar is not None:
            bar.watch(s)
            for _ in stream:
                pass
        else:
            next_mark, done = 0.1, 0
            for name, _ in stream:
                done += sizes[name]
                if s.bytes_total and done / s.bytes_total >= next_mark - 1e-9:
                    print(f"{100 * done // s.bytes_total:3d}% {progress.size(done)} {s.gbps:.2f} GB/s "
                          f"{s.tensors_done}/{s.tensors_total} tensors", flush=True)  # fmt: skip
                    next_mark = min(1.0, done / s.bytes_total + 0.1) if done < s.bytes_total else 2.0
    print(f"{s.tensors_done} tensors, {progress.size(s.bytes_read)} to {s.device} via {s.reader} in {s.elapsed:.2f} s "
          f"({s.gbps:.2f} GB/s), first tensor after {1e3 * (s.time_to_first_tensor or 0):.1f} ms")  # fmt: skip
    if args.verify:
        print(f"verified: {s.bytes_verified / 1e9:.2f} GB matched their digests")
    if peers:  # what they served of this load: the process's tally after it, less the tally before
        served, source = (after - before for after, before in zip(TALLY.read(), tallied, strict=True))
        if not served + source:  # no load read through peers: the warnings above say why (or a cache held it all)
            print("peers: served nothing; no byte of this load was read through them (see any warnings above)")
        else:
            print(f"peers: served {progress.size(served)} of {progress.size(served + source)} "
                  f"({100 * served / (served + source):.0f}%), the source {progress.size(source)}")  # fmt: skip


def _bench(args: argparse.Namespace) -> int:
    from streamload.commands import bench
    from streamload.plan.checkpoint import open_checkpoint

    if args.list:
        for scheme in ("file", "s3"):
            runs, notes = bench.available([ld.name for ld in bench.LOADERS], args.device, scheme)
            for name in runs:
                print(f"{name:26} runs here ({scheme} storage, device {args.device})")
            for note in notes:
                if "does not read" not in note:
                    print(f"  {note}")
        return 0
    if args.path is None:
        print("streamload: error: bench needs a checkpoint PATH (or --list)", file=sys.stderr)
        return 2
    for flag, out in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if out is not None and (why := _unwritable(out)):  # before the runs, not after minutes of them
            raise StreamloadError(f"{flag} {out}: cannot write there: {why}")
    from streamload import device
    from streamload.pipeline import reader_choice

    reader_choice.usable(device.resolve(args.device))  # before any run, not in each run's failure
    if args.sweep:
        if args.loaders or args.verify:
            print(
                "streamload: error: --sweep times streamload alone: leave out --loaders and --verify", file=sys.stderr
            )
            return 2
        return _sweep(args, bench)
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the runs, not after them
        raise StreamloadError("--plot needs matplotlib: pip install matplotlib")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("streamload: note: PYTHONDONTWRITEBYTECODE is set: a loader installed without bytecode caches "
              "(an editable install) compiles its sources in every run, inside the clock", file=sys.stderr)  # fmt: skip
    total = open_checkpoint(args.path).nbytes
    modes = tuple(m for m, on in (("cold", args.cold), ("warm", args.warm or not args.cold)) if on)
    loaders = args.loaders
    if args.verify:
        from streamload.pipeline.verify import choose

        try:  # before the runs: a checkpoint without digests would fail every verify run alike
            choose(open_checkpoint(args.path), True)
        except StreamloadError as exc:
            raise StreamloadError(f"--verify needs the files' digests: run `streamload digest "
                                  f"{redacted(args.path)}` first ({exc})") from None  # fmt: skip
        if loaders is None:
            readers = ("mmap", "posix") if "mapped" in device.kind_of(args.device).lands else ("posix",)
            loaders = [f"streamload-{r}" for r in readers]
        known = {ld.name for ld in bench.LOADERS}  # each streamload loader named, with and without verify=
        loaders = [v for n in loaders for v in (n, f"{n}+verify") if v == n or (v in known and v not in loaders)]
        for name, rate in bench.hash_rates().items():
            print(f"{name}: {rate:.2f} GB/s on one core", file=sys.stderr, flush=True)
    summaries = bench.bench(args.path, device=args.device, modes=modes, runs=args.runs or 5, loaders=loaders,
                            log=lambda line: print(line, file=sys.stderr, flush=True), keep=not args.drop)  # fmt: skip
    rows = bench.report(summaries, total)
    text = bench.table(rows, total)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        raw = [{"loader": s.loader, "mode": s.mode, "runs": [vars(r) for r in s.runs], "failures": s.failures}
               for s in summaries]  # fmt: skip
        args.json.write_text(json.dumps({"bytes": total, "device": args.device, "rows": rows, "raw": raw}, indent=1))
    if args.plot and rows:
        bench.plot(summaries, rows, total, args.plot)
    if not any(s.runs for s in summaries):
        raise StreamloadError("no loader ran")
    if failed := sorted({s.loader for s in summaries if s.failures and not s.runs}):
        raise StreamloadError(f"failed in every run: {', '.join(failed)}")
    return 0


def _unwritable(path: Path) -> str | None:
    """Why a file cannot be written at `path` (its folder missing, read-only, not ours), else None: a
    file made and removed there, the real test (a mode says nothing of a read-only mount)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path.parent):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _sweep(args: argparse.Namespace, bench: Any) -> int:
    settings = bench.sweep(args.path, device=args.device, cold=args.cold, runs=args.runs or 3,
                           log=lambda line: print(line, flush=True))  # fmt: skip
    best = min(settings, key=lambda s: s.seconds)
    default = settings[0]
    low, high = best.spread
    print(f"\nbest: {best.describe()}: {best.seconds:.3f} s, {default.seconds / best.seconds:.2f}x the defaults "
          f"({default.seconds:.3f} s); medians of {args.runs or 3} runs, the best's {low:.3f}-{high:.3f} s, "
          f"the defaults' {default.spread[0]:.3f}-{default.spread[1]:.3f} s")  # fmt: skip
    if best is not default and best.spread[1] >= default.spread[0]:
        print("  (their runs overlap: within this storage's noise; more --runs tell them apart)")
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in best.options.items())
    print(f"  streamload load PATH {flags}")
    print(f"  streamload.iter(path, {', '.join(f'{k}={v}' for k, v in best.options.items())})")
    return 0
