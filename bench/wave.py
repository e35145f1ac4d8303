"""A wave of nodes that start together (docs/peers.md, "Nodes that start together") over a simulated network
(testbed/netsim.py): N nodes load one checkpoint at the same moment, each with its own `cache_dir`, its
in-process seeder on its own address and `peers=` every node's seeder; against the same N nodes each pulling
the checkpoint from the store. Needs root and nginx (see testbed/netsim.py).

    python bench/peers.py DIR --make --layers 3        # the llama-shaped checkpoint (0.57 GB in 2 shards)
    python bench/wave.py DIR --nodes 8 --storage-mbit 200 --node-mbit 1000 --kill --json defaults.json
    python bench/wave.py DIR --no-baseline --kill --header-timeout 20 --also defaults.json --plot wave.png

Each node is a fresh process in its namespace (`python bench/wave.py node ...`): it imports, starts its
seeder (in a wave), says it is ready, and waits for a line on stdin; the line is written to every node at
once (the start), and its clock runs from reading it to the return of `streamload.load`. Runs:
- independent pulls (the baseline, unless `--no-baseline`): every node loads from the store, no peers;
- the wave: every node with its seeder and `peers=` all N seeders (`--header-timeout`: the seeders', whose
  half caps the long poll a request for bytes not yet verified waits; else their default);
- with `--kill`: the wave again, node 3 SIGKILLed a third of the wave's time in (its seeder with it).
Measured: each node's time, its CPU time (its process, every thread: the load and its seeder), the bytes its
seeder sent and its GETs answered 206 or 404, the bytes its load read from the store; the bytes the store
served (nginx's log: response bodies); every ~0.25 s, the bytes each host put on its link (the bridge ports'
counters: TCP/IP framing and acknowledgements included), the store's responses in flight and the machine's
busy CPU (the picture: `--plot`). Once every node's load has ended (so that no hashing competes with a load),
each node's tensors are compared with the checkpoint's own (SHA-256 of each tensor's bytes). Every wait has a
deadline, and the `with Net` removes what it made on every way out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]

PORT = 8470
EVERY = 0.25  # seconds between samples of the links' counters
STARTUP = 240.0  # seconds N nodes may take to import and start their seeders (two cores for all of them)


# -- a node (inside its namespace) ---------------------------------------------------------------------------
def node_main(argv: list[str]) -> None:
    """One node: ready (its seeder serving), the start line, the load timed, `done`; the stop line, its tensors'
    digests and its seeder's requests, `final`. Ends by itself at `--deadline` or when stdin closes."""
    import faulthandler
    import logging

    ap = argparse.ArgumentParser(prog="wave.py node")
    ap.add_argument("url")
    ap.add_argument("cache", type=Path)
    ap.add_argument("--seed", default="", help="host: serve the cache on it (port PORT)")
    ap.add_argument("--peers", default="", help="comma-separated peer URLs")
    ap.add_argument("--deadline", type=float, default=900)
    ap.add_argument("--header-timeout", type=float, default=None, help="the seeder's (its long poll: half of it)")
    args = ap.parse_args(argv)
    ending = threading.Timer(args.deadline, lambda: os._exit(4))  # bounded whatever happens
    ending.daemon = True
    ending.start()
    faulthandler.register(signal.SIGUSR1)  # the parent asks a straggler where it is
    logging.basicConfig(format="%(asctime)s %(threadName)s %(levelname)s %(message)s", level=logging.WARNING)
    logging.getLogger("streamload").setLevel(logging.INFO)

    import torch

    import streamload
    from streamload.servers.seed import Seeder
    from streamload.storage.peers import TALLY

    bounds = {"header_timeout": args.header_timeout} if args.header_timeout else {}
    seeder = Seeder(args.cache, args.seed, PORT, **bounds).start() if args.seed else None
    print("ready", flush=True)
    if not sys.stdin.readline():
        os._exit(5)
    began, cpu = time.time(), time.process_time()
    peers = args.peers.split(",") if args.peers else None
    try:
        state = streamload.load(args.url, device="cpu", cache_dir=str(args.cache), peers=peers)
    except Exception as exc:  # said, and the node ends (its seeder with it)
        print("failed " + json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
        os._exit(3)
    seconds, cpu = time.time() - began, time.process_time() - cpu
    from_peers, from_source = TALLY.read()
    done = {"began": began, "seconds": seconds, "cpu": cpu, "from_source": from_source, "from_peers": from_peers,
            "sent": seeder.sent if seeder else 0}  # fmt: skip
    print("done " + json.dumps(done), flush=True)
    if not sys.stdin.readline():
        os._exit(5)
    digests = {n: hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy()).hexdigest()
               for n, t in state.items()}  # fmt: skip
    asked = Counter(f"{method} {status}" for method, _, status in (seeder.requests if seeder else []))
    final = {"digests": digests, "sent": seeder.sent if seeder else 0, "requests": dict(asked)}
    print("final " + json.dumps(final), flush=True)
    if seeder is not None:
        seeder.close()
    os._exit(0)  # the deadline's timer is not waited for


# -- the parent ------------------------------------------------------------------------------------------------
class Node:
    """A node's process, the lines it prints (read on a thread of their own) and its log file."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc, self.log = proc, log
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ended = False  # its stdout closed: no more lines
        self.failure: str | None = None  # what its load raised
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, word: str, until: float) -> str | None:
        """The rest of the next line that starts with `word`, before `until` (monotonic); None if none came."""
        while not self.ended and (left := until - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self.ended = True
            elif line.split(" ", 1)[0] == "failed":
                self.failure = json.loads(line.split(" ", 1)[1])["error"]
            elif line.split(" ", 1)[0] == word:
                return line[len(word) :].strip()
        return None

    def say(self, text: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # a killed node

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class Sampler:
    """Every `EVERY` s: the bytes each host sent on its link (the switch's end of each veth receives what the
    host sends: /proc/<pid>/net/dev of a process in the switch's namespace), the store's served bodies, its
    responses in flight (its sockets on port 80 with bytes queued: /proc/<pid>/net/tcp of a process in the
    store's namespace), and the machine's busy CPU (/proc/stat)."""

    def __init__(self, net: Any, hosts: list[str], deadline: float) -> None:
        self.net = net
        self.ports = {f"{net.prefix}{h}b": h for h in hosts}
        self.holders = {h: subprocess.Popen(["ip", "netns", "exec", net.ns(h), "sleep", str(int(deadline))])
                        for h in ("sw", "s")}  # fmt: skip
        until = time.monotonic() + 10
        while not all(_inside(p.pid, net.ns(h)) for h, p in self.holders.items()):  # once `ip` runs `sleep`
            if time.monotonic() > until:
                raise RuntimeError(f"no process of ours in {net.ns('sw')} or {net.ns('s')}")
            time.sleep(0.01)
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> dict[str, Any]:
        sent = {}
        for line in Path(f"/proc/{self.holders['sw'].pid}/net/dev").read_text().splitlines()[2:]:
            name, fields = line.split(":", 1)
            if name.strip() in self.ports:
                sent[self.ports[name.strip()]] = int(fields.split()[0])  # received by the switch: sent by the host
        sockets = [line.split() for line in Path(f"/proc/{self.holders['s'].pid}/net/tcp").read_text().splitlines()[1:]]
        flight = sum(1 for f in sockets if f[1].endswith(":0050") and f[3] == "01" and int(f[4].split(":")[0], 16))
        cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return {"t": time.time(), "sent": sent, "served": self.net.served(), "flight": flight,
                "busy": sum(cpu) - cpu[3] - cpu[4], "total": sum(cpu)}  # fmt: skip

    def start(self) -> Sampler:
        self.samples.append(self.read())
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(EVERY):
            self.samples.append(self.read())

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.read())
        return self.samples

    def close(self) -> None:
        for holder in self.holders.values():
            if holder.poll() is None:
                holder.kill()
            holder.wait()


def _inside(pid: int, namespace: str) -> bool:
    """Whether process `pid` is in the network namespace `namespace` (made by `ip netns add`)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{namespace}").st_ino
    except FileNotFoundError:
        return False


def spawn(net: Any, i: int, cache: Path, log: Path, wave: bool, deadline: float, header_timeout: float | None) -> Node:
    cache.mkdir(parents=True)
    peers = ",".join(f"http://{ip}:{PORT}" for ip in net.node_ips) if wave else ""
    argv = [sys.executable, str(Path(__file__).resolve()), "node", net.url, str(cache)]
    argv += ["--deadline", str(int(deadline))]
    argv += ["--seed", net.node_ips[i], "--peers", peers] if wave else []
    argv += ["--header-timeout", str(header_timeout)] if header_timeout else []
    with open(log, "w") as err:
        proc = net.start(i, argv, cwd=ROOT, env=net.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    return Node(proc, log)


def run(net: Any, name: str, work: Path, wave: bool, deadline: float, kill: tuple[int, float] | None = None,
        header_timeout: float | None = None) -> dict:  # fmt: skip
    """One run: N fresh nodes (caches under `work`), started together; `kill`: (node, seconds) SIGKILLed then;
    `header_timeout`: the seeders' (None: their default)."""
    nodes = [spawn(net, i, work / name / f"cache{i}", work / f"{name}-node{i}.log", wave, deadline + STARTUP,
                   header_timeout) for i in range(net.nodes)]  # fmt: skip
    until = time.monotonic() + STARTUP
    for i, node in enumerate(nodes):
        if node.expect("ready", until) is None:
            raise RuntimeError(f"{name}: node {i} did not start:\n{node.tail()}")
    sampler = Sampler(net, ["s", *(f"n{i}" for i in range(net.nodes))], deadline + 60)
    try:
        before = net.served()
        sampler.start()
        began = time.time()
        for node in nodes:
            node.say("go")
        killer = None
        if kill is not None:
            killer = threading.Timer(kill[1], lambda: nodes[kill[0]].proc.send_signal(signal.SIGKILL))
            killer.start()
        until = time.monotonic() + deadline
        done = {i: node.expect("done", until) for i, node in enumerate(nodes)}
        if killer is not None:
            killer.join()
        samples = sampler.stop()
        served = net.served() - before
        stragglers = [i for i, got in done.items() if got is None and nodes[i].proc.poll() is None]
        for i in stragglers:  # where each is: its threads' stacks into its log
            nodes[i].proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0 if stragglers else 0.0)
        for node in nodes:
            node.say("stop")
        final = {i: node.expect("final", time.monotonic() + 120) for i, node in enumerate(nodes)}
    finally:
        sampler.close()
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait(10)
        shutil.rmtree(work / name, ignore_errors=True)  # the caches (N copies of the checkpoint), once ended
    said = [{**json.loads(done[i] or "{}"), **json.loads(final[i] or "{}")} for i in range(len(nodes))]
    for got, node in zip(said, nodes, strict=True):
        if node.failure:
            got["error"] = node.failure
    return {"name": name, "began": began, "served": served, "killed": kill, "stragglers": stragglers,
            "samples": samples, "nodes": said,
            "logs": {i: node.tail(20000) for i, node in enumerate(nodes) if i in stragglers}}  # fmt: skip


# -- the figures -----------------------------------------------------------------------------------------------
def summarize(result: dict, want: dict[str, str], size: int, target: float) -> list[str]:
    """The run's table and its line (markdown); each node's verdict on its tensors kept in `result`."""
    lines = [f"### {result['name']}", "", "| node | time (s) | CPU (s) | from the store (GB) | its seeder sent (GB) "
             "| its seeder's GETs: 206 / 404 | tensors |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, n in enumerate(result["nodes"]):
        n["exact"] = verdict(n, want, killed=result["killed"] is not None and result["killed"][0] == i)
        asked = n.get("requests", {})
        cells = [f"{n['seconds']:.1f}", f"{n['cpu']:.1f}"] if "seconds" in n else ["-", "-"]
        cells += [f"{n['from_source'] / 1e9:.3f}" if n.get("from_peers", 0) + n.get("from_source", 0) else "-"]
        cells += (
            [f"{n['sent'] / 1e9:.3f}", f"{asked.get('GET 206', 0)} / {asked.get('GET 404', 0)}"]
            if asked
            else ["-", "-"]
        )
        lines.append(f"| {i} | {' | '.join(cells)} | {n['exact']} |")
    times = [n["seconds"] for n in result["nodes"] if "seconds" in n]
    result["max"] = max(times, default=None)
    first, last = result["samples"][0], result["samples"][-1]
    result["machine_busy"] = (last["busy"] - first["busy"]) / max(1, last["total"] - first["total"])
    flight = sorted(s["flight"] for s in result["samples"])
    cpu, span, busy = sum(n.get("cpu", 0.0) for n in result["nodes"]), last["t"] - first["t"], result["machine_busy"]
    lines += ["", f"The store served {result['served'] / 1e9:.3f} GB = **{result['served'] / size:.2f}x** the "
              f"checkpoint; the slowest node {result['max'] or float('nan'):.1f} s (target {target:.1f} s); the "
              f"store's responses in flight: median {flight[len(flight) // 2]}, most {flight[-1]}; the nodes' CPU "
              f"{cpu:.0f} s in {span:.0f} s of 2 cores, the machine's CPU {busy:.0%} busy.", ""]  # fmt: skip
    lines += [f"node {i} failed: {n['error']}" for i, n in enumerate(result["nodes"]) if "error" in n]
    if result["stragglers"]:
        lines.append(f"stragglers (no `done` within the deadline): {result['stragglers']}")
    return lines


def verdict(node: dict, want: dict[str, str], killed: bool) -> str:
    if "digests" not in node:
        return "SIGKILLed" if killed else "no result"
    bad = sum(1 for k, d in want.items() if node["digests"].get(k) != d) + len(set(node["digests"]) - set(want))
    return "exact" if not bad else f"WRONG: {bad} tensors differ"


def plot(results: list[dict], size: int, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(results))
    rows = -(-len(results) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(results) :]:
        ax.set_visible(False)
    for ax, result in zip(axes.flat, results, strict=False):
        samples = result["samples"]
        t = [s["t"] - result["began"] for s in samples]
        base = samples[0]["sent"]
        ax.plot(t, [(s["sent"]["s"] - base["s"]) / size for s in samples], color="black", lw=2.2, label="store")
        for i in range(len(result["nodes"])):
            h = f"n{i}"
            ax.plot(t, [(s["sent"][h] - base[h]) / size for s in samples], lw=1, label=f"node {i}")
        for n in result["nodes"]:
            if "seconds" in n:
                ax.axvline(n["seconds"], color="grey", lw=0.5, ls=":")
        if "wave" in result["name"]:
            ax.axvline(target, color="red", lw=1, ls="--", label="target")
        ax.set_title(result["name"], fontsize=9)
        ax.set_xlabel("seconds since the start (dotted: a node done)", fontsize=8)
        ax.set_ylabel("bytes sent / checkpoint", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes.flat[len(results) - 1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def _past_deadline(signum: int, frame: Any) -> None:
    raise TimeoutError("the bench's deadline passed")  # the `with Net` removes what it made


def main() -> None:
    if sys.argv[1:2] == ["node"]:
        node_main(sys.argv[2:])
        return
    from bench.peers import publish_digests, reference
    from streamload.storage.peers import timeout as peer_timeout
    from testbed.netsim import Net

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--storage-mbit", type=float, default=200)
    ap.add_argument("--node-mbit", type=float, default=1000)
    ap.add_argument("--kill", action="store_true", help="also: the wave with one node SIGKILLed a third in")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--header-timeout", type=float, default=None,
                    help="the seeders' header timeout in every wave (their long poll: at most half of it)")  # fmt: skip
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--also", type=Path, nargs="*", default=[], help="--json files of earlier runs, drawn first")
    ap.add_argument("--json", type=Path, default=None, help="every run's figures and samples")
    ap.add_argument("--logs", type=Path, default=None, help="keep the nodes' logs (INFO) here")
    args = ap.parse_args()
    folder = args.folder.resolve()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    at_store = size * 8 / (args.storage_mbit * 1e6)
    target = 1.3 * at_store + 1.0
    deadline = 3 * args.nodes * at_store + 120  # the baseline's time, three times over
    signal.signal(signal.SIGALRM, _past_deadline)
    signal.alarm(int(2 * STARTUP + deadline + 6 * target + 600))  # everything, whatever happens
    want = reference(folder)
    results = []
    with tempfile.TemporaryDirectory(prefix="streamload-wave-") as tmp, \
            Net(folder, nodes=args.nodes, storage_mbit=args.storage_mbit, node_mbit=args.node_mbit) as net:  # fmt: skip
        work = args.logs.resolve() if args.logs else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        publish_digests(net, folder)
        if not args.no_baseline:
            results.append(run(net, f"{args.nodes} independent pulls", work, False, deadline))
        poll = f", long poll {min(args.header_timeout / 2, 2 * peer_timeout()):g} s" if args.header_timeout else ""
        wave = f"a wave of {args.nodes}{poll}"
        results.append(run(net, wave, work, True, 10 * target, None, args.header_timeout))
        if args.kill:
            third = max((n.get("seconds", 0.0) for n in results[-1]["nodes"]), default=0.0) / 3 or target / 3
            victim = min(3, args.nodes - 1)
            name = f"{wave}, node {victim} SIGKILLed at {third:.0f} s"
            results.append(run(net, name, work, True, 10 * target, (victim, third), args.header_timeout))
    signal.alarm(0)
    print(f"{folder}: {size / 1e9:.3f} GB; {args.nodes} nodes; the store {args.storage_mbit:g} Mbit/s (the checkpoint "
          f"in {at_store:.2f} s; target {target:.2f} s); node links {args.node_mbit:g} Mbit/s")  # fmt: skip
    for result in results:
        print("\n".join(summarize(result, want, size, target)))
    if args.json:
        kept = [{**r, "nodes": [{k: v for k, v in n.items() if k != "digests"} for n in r["nodes"]]} for r in results]
        args.json.write_text(json.dumps({"size": size, "at_store": at_store, "target": target, "runs": kept}))
    if args.plot:
        earlier = [r for also in args.also for r in json.loads(also.read_text())["runs"]]
        plot(earlier + results, size, target, args.plot)


if __name__ == "__main__":
    main()
