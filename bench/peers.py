"""Peers over a simulated network (testbed/netsim.py): a late-joining node loads from nodes that already
hold the checkpoint and seed it, while the store is capped. Needs root and nginx (see testbed/netsim.py).

    python bench/peers.py DIR --make --layers 4          # a llama-shaped checkpoint (~0.5 GB) + its digests
    python bench/peers.py DIR --nodes 4 --storage-mbit 200 --node-mbit 1000

What it measures, each node a fresh process (`python -m testbed.fleet_node`, clock after imports):
- store alone: node 0 loads from the store with no peers (the baseline a joiner has without them);
- joiner: nodes 1..N-1 hold complete copies in their cache and seed them (`python -m streamload seed`),
  node 0 loads with `peers=` those nodes: its time against the checkpoint's time at the node link's rate,
  and the share of the checkpoint the store served it;
- a peer killed: the same, one seeder SIGKILLed once a third of the time has passed;
- a peer with one flipped byte: node 0 loads with that one peer, whose copy has a byte flipped (its record
  still vouching for it, as after bit rot): the tensors exact, the peer named;
- a slow peer: node 0 loads with one peer whose seeder is capped at 2 MB/s, slower than the store: the peer
  loses its ranges within about a second, the store serves the rest (against the store alone);
- a seeding node's own load: node 3 loads from its own cache (the copies) alone, beside node 0 pulling
  from another node (this machine's cores are every node's: the joiner's work competes as much), and
  while node 0 pulls from it.
Every load's tensors are compared with the checkpoint's own (SHA-256 of each tensor's bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

from testbed.fleet_node import start  # noqa: E402
from testbed.netsim import Net  # noqa: E402

PORT = 8470


def make(folder: Path, layers: int) -> None:
    from streamload.commands.demo import Shape, write_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    write_checkpoint(folder, Shape(vocab=32000, hidden=2048, intermediate=5632, layers=layers), 2)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"wrote {folder}: {size / 1e9:.2f} GB (its digests are made from the store's objects at each run)")


def publish_digests(net: Net, folder: Path) -> None:
    """The digest file made by reading the checkpoint from the store (each entry bound to its object's ETag,
    as nginx makes it), published beside the objects: peers are used only with such digests."""
    argv = [sys.executable, "-m", "streamload", "digest", net.url, "--out", str(folder / "streamload.digests.json")]
    done = net.start(0, argv, cwd=ROOT, env=net.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if done.wait(timeout=300) != 0:
        raise SystemExit(f"streamload digest {net.url} failed: {done.stderr.read() if done.stderr else ''}")


def reference(folder: Path) -> dict[str, str]:
    import torch
    from safetensors.torch import load_file

    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            out[name] = hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy()).hexdigest()
    return out


def load(net: Net, node: int, url: str, cache: Path, peers: list[str] | None = None,
         during: tuple[float, object] | None = None) -> dict:  # fmt: skip
    """Node `node` loads `url` into `cache` (with `peers`); `during`: (seconds, action) run that long after start."""
    options: dict[str, object] = {"cache_dir": str(cache)}
    if peers:
        options["peers"] = peers
    proc = start(net, node, [url], "--options", json.dumps(options))
    timer = None
    if during is not None:
        timer = threading.Timer(during[0], during[1])  # type: ignore[arg-type]
        timer.start()
    out, err = proc.communicate(timeout=600)
    if timer is not None:
        timer.cancel()
    if proc.returncode != 0:
        raise RuntimeError(f"node {node} failed ({proc.returncode}): {err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["warnings"] = [line for line in err.splitlines() if "peer" in line.lower()]
    return result


def seed(net: Net, node: int, cache: Path, rate: str | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "streamload", "seed", "--cache-dir", str(cache), "--host", net.node_ips[node],
            "--port", str(PORT), *(["--rate", rate] if rate else [])]  # fmt: skip
    proc = net.start(node, argv, cwd=ROOT, env=net.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # its first line names the URL: it is serving
    return proc


def flip_one_byte(cache: Path, at: float = 0.5) -> Path:
    """One byte of the largest copy in `cache` flipped, its modification time kept (its record still vouches)."""
    copy = max((p for p in cache.rglob("*.safetensors") if ".partial" not in p.name), key=lambda p: p.stat().st_size)
    st = copy.stat()
    with open(copy, "r+b") as f:
        f.seek(int(st.st_size * at))
        b = f.read(1)
        f.seek(int(st.st_size * at))
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--make", action="store_true")
    ap.add_argument("--layers", type=int, default=4, help="4 layers: ~0.55 GB")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--storage-mbit", type=float, default=200)
    ap.add_argument("--node-mbit", type=float, default=1000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.make:
        make(args.folder, args.layers)
        return
    folder = args.folder.resolve()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    want = reference(folder)
    link_seconds = size * 8 / (args.node_mbit * 1e6)
    rows: list[tuple[str, str, str]] = []
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="streamload-peers-") as tmp, \
            Net(folder, nodes=args.nodes, storage_mbit=args.storage_mbit, node_mbit=args.node_mbit) as net:  # fmt: skip
        url = net.url
        publish_digests(net, folder)
        caches = [Path(tmp) / f"cache{i}" for i in range(args.nodes)]

        def fresh(i: int) -> Path:
            shutil.rmtree(caches[i], ignore_errors=True)
            caches[i].mkdir()
            return caches[i]

        def check(name: str, got: dict) -> str:
            bad = [n for n, d in want.items() if got["digests"].get(n) != d]
            return "exact" if not bad and len(got["digests"]) == len(want) else f"WRONG: {len(bad)} tensors differ"

        # Store alone: node 0, no peers.
        before = net.served()
        alone = load(net, 0, url, fresh(0))
        results["store alone"] = alone | {"served": net.served() - before}
        rows.append(("store alone", f"{alone['seconds']:.1f} s ({alone['seconds'] / link_seconds:.1f}x the link)",
                     f"store served {(net.served() - before) / size:.2f}x; {check('alone', alone)}"))  # fmt: skip

        # Seeders: node 1 from the store, the others from node 1 (fast), then all seed.
        load(net, 1, url, fresh(1))
        for i in range(2, args.nodes):
            load(net, i, url, fresh(i), [f"http://{net.node_ips[1]}:{PORT}"])
        seeders = {i: seed(net, i, caches[i]) for i in range(1, args.nodes)}
        peers = [f"http://{net.node_ips[i]}:{PORT}" for i in seeders]

        def joiner(name: str, peers: list[str], during: tuple[float, object] | None = None) -> dict:
            before = net.served()
            got = load(net, 0, url, fresh(0), peers, during)
            served = net.served() - before
            results[name] = got | {"served": served}
            named = "; ".join(sorted({w.split("streamload: ", 1)[-1][:160] for w in got["warnings"]}))
            said = f"store served {served / size:.1%}; {check(name, got)}" + (f"; {named}" if named else "")
            rows.append((name, f"{got['seconds']:.2f} s ({got['seconds'] / link_seconds:.2f}x the link)", said))
            return got

        joined = joiner("joiner, 3 peers", peers)
        victim = seeders[1]
        kill = (joined["seconds"] / 3, lambda: victim.send_signal(signal.SIGKILL))
        joiner("joiner, 3 peers, one SIGKILLed at 1/3", peers, kill)
        victim.wait(10)
        flip_one_byte(caches[2])  # the one peer asked: every block of that copy comes from it
        joiner("joiner, 1 peer, a byte of its copy flipped", [f"http://{net.node_ips[2]}:{PORT}"])
        slow = seed(net, 1, caches[1], rate="2MB")  # node 1's seeder again (SIGKILLed above), capped at 2 MB/s
        joiner("joiner, 1 peer capped at 2 MB/s (slower than the store)", [f"http://{net.node_ips[1]}:{PORT}"])
        slow.terminate()
        slow.wait(10)

        # A seeding node's own load (from its own cache): alone; while node 0 pulls from another node (the
        # machine's 2 cores shared as when it seeds: the joiner runs here too); while node 0 pulls from it.
        own = caches[3]
        alone_own = load(net, 3, url, own)

        def beside(source: int) -> dict:
            pulled: dict[str, dict] = {}
            puller = threading.Thread(
                target=lambda: pulled.update(j=load(net, 0, url, fresh(0), [f"http://{net.node_ips[source]}:{PORT}"]))
            )
            puller.start()
            time.sleep(1.0)  # the pull under way
            got = load(net, 3, url, own)
            puller.join()
            return got

        control = beside(2)
        seeding = beside(3)
        rows.append(("seeding node's own load (from its cache)",
                     f"alone {alone_own['seconds']:.2f} s; beside a pull from another node {control['seconds']:.2f} s; "
                     f"seeding {seeding['seconds']:.2f} s",
                     f"seeding / beside {seeding['seconds'] / control['seconds']:.2f}x, seeding / alone "
                     f"{seeding['seconds'] / alone_own['seconds']:.2f}x; {check('own', seeding)}"))  # fmt: skip
        results["own"] = {"alone": alone_own["seconds"], "beside": control["seconds"], "seeding": seeding["seconds"]}
        for proc in seeders.values():
            if proc.poll() is None:
                proc.terminate()
    print(
        f"{folder}: {size / 1e9:.2f} GB; {args.nodes} nodes, store {args.storage_mbit:g} Mbit/s, "
        f"node links {args.node_mbit:g} Mbit/s (the checkpoint's time at that rate: {link_seconds:.2f} s)"
    )
    print("| run | time | store / result |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        for r in results.values():
            r.pop("digests", None)
        args.json.write_text(json.dumps({"size": size, "link_seconds": link_seconds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
