"""Several hosts on one machine, for loads that cross a network: network namespaces joined by veth
links on a bridge (itself in a namespace of its own, so nothing is added to the machine's own
network), one storage host serving a directory over HTTP like an object store, and N nodes.

The store is nginx (Debian's `nginx-light` and `libnginx-mod-http-echo`): HTTP Range, a first-byte
latency per request (`echo_sleep` before the body: this kernel has no `netem`), a rate cap per
connection (`limit_rate`), a share of requests answered `503` as a throttling object store does or
whose connection is dropped unanswered (`split_clients`); the storage host's egress is capped with
`tc` (htb), as is every node's link where asked (a straggler: one node's link slower). With `s3=True`
it answers S3's path-style GETs instead (`s3://models/<file>`, endpoint and keys in `Net.env()`).
Needs root, `ip`, `tc` and nginx with the echo module: `Net.missing()` says what is not there.
Everything made is removed on leaving the `with` block — on success, failure or Ctrl-C — and every
command runs under a deadline.

    with Net(Path("ckpt"), nodes=3, storage_mbit=200, first_byte_ms=30, connection_mbps=10) as net:
        done = net.run(0, [sys.executable, "-c", "..."], timeout=60)   # inside node 0's namespace
        print(net.url, net.served())                                   # http://10.x.y.1/, bytes sent
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")
BUCKET = "models"
SLOW_DOWN = "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"


class Net:
    """A storage host and `nodes` nodes on one bridge (see the module's docstring). Rates: `storage_mbit`
    (the store's egress, Mbit/s), `connection_mbps` (each HTTP connection, MB/s), `node_mbit` (each
    node's link both ways, None: uncapped; a dict {node: Mbit/s} for some)."""

    def __init__(
        self,
        root: Path,
        nodes: int = 1,
        *,
        storage_mbit: float | None = None,
        connection_mbps: float | None = None,
        first_byte_ms: float = 0.0,
        node_mbit: float | dict[int, float] | None = None,
        slow_down_percent: float = 0.0,
        reset_percent: float = 0.0,
        s3: bool = False,
    ) -> None:
        self.root, self.nodes = Path(root).resolve(), nodes
        self.storage_mbit, self.connection_mbps, self.first_byte_ms = storage_mbit, connection_mbps, first_byte_ms
        self.slow_down_percent = slow_down_percent  # of requests answered 503 SlowDown, as S3 throttles
        self.reset_percent = reset_percent  # of requests whose connection is closed with no answer (nginx's 444)
        self.node_mbit = node_mbit if isinstance(node_mbit, dict) else dict.fromkeys(range(nodes), node_mbit)
        tag = f"{os.getpid() % 4096:03x}{random.randrange(16):x}"
        self.prefix = f"sl{tag}"
        subnet = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"
        self.storage_ip = f"{subnet}.1"
        self.node_ips = [f"{subnet}.{i + 2}" for i in range(nodes)]
        self.s3 = s3
        self.url = f"s3://{BUCKET}/" if s3 else f"http://{self.storage_ip}/"
        self._made: list[str] = []  # namespaces, removed in reverse
        self._procs: list[subprocess.Popen[Any]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @staticmethod
    def missing() -> str:
        """Why this machine cannot run a `Net` (empty: it can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc", "nginx"):
            if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
                return f"`{tool}` is not installed (Debian: iproute2, nginx-light)"
        if not ECHO_MODULE.exists():
            return f"{ECHO_MODULE} is missing (Debian: libnginx-mod-http-echo)"
        return ""

    # --- hosts
    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def node(self, i: int) -> str:
        return self.ns(f"n{i}")

    def __enter__(self) -> Net:
        why = self.missing()
        if why:
            raise RuntimeError(why)
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _interrupt)  # a killed test run still tears down (as Ctrl-C does)
        self._previous_sigterm = previous
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:  # asked first (nginx stops its workers), then killed
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        for name in reversed(self._made):  # a namespace takes its veth ends with it
            _kill_in(name)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
        self._made.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
        signal.signal(signal.SIGTERM, getattr(self, "_previous_sigterm", signal.SIG_DFL))

    def _build(self) -> None:
        switch = self.ns("sw")
        self._add_ns(switch)
        _ip(switch, "link", "add", "br0", "type", "bridge")
        _ip(switch, "link", "set", "br0", "up")
        hosts = [("s", self.storage_ip, self.storage_mbit, None)]
        hosts += [(f"n{i}", ip, None, self.node_mbit.get(i)) for i, ip in enumerate(self.node_ips)]
        for host, address, egress, both in hosts:
            name = self.ns(host)
            self._add_ns(name)
            outer, inner = f"{self.prefix}{host}b", f"{self.prefix}{host}h"  # <= 15 characters
            _ip(switch, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name)
            _ip(switch, "link", "set", outer, "master", "br0", "up")
            _ip(name, "link", "set", inner, "name", "eth0")
            _ip(name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip(name, "link", "set", "eth0", "up")
            _ip(name, "link", "set", "lo", "up")
            cap = egress or both
            if cap:  # what leaves the host
                _rate(name, "eth0", cap)
            if both:  # and what reaches it (the switch's end sends towards the host)
                _rate(switch, outer, both)
        self._start_store()

    def _add_ns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        self._made.append(name)

    def env(self) -> dict[str, str]:
        """The environment a node's process needs to reach the store (S3's endpoint and keys)."""
        if not self.s3:
            return dict(os.environ)
        keys = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
        keys |= {"AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        path_style = {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}  # runai's reader, on an endpoint by address
        return {**os.environ, **keys, **path_style, "AWS_ENDPOINT_URL": f"http://{self.storage_ip}"}

    def _start_store(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="streamload-net-")
        tmp = Path(self._tmp.name)
        delay = f"echo_sleep {self.first_byte_ms / 1000:.3f}; " if self.first_byte_ms else ""
        limit = f"limit_rate {int(self.connection_mbps * 1e6)};" if self.connection_mbps else ""
        faults = f"{self.slow_down_percent}% 503; " if self.slow_down_percent else ""
        faults += f"{self.reset_percent}% 444; " if self.reset_percent else ""
        root = self.root
        if self.s3:  # S3's path-style GET /bucket/key (signed; the signature is not checked): the bucket
            # is the directory. What a load uses of S3 is there: Range, ETag, If-Match, 503 SlowDown.
            root = tmp / "s3"
            root.mkdir()
            (root / BUCKET).symlink_to(self.root)
        serve = f"location @file {{ root {root}; {limit} }}"
        temp = " ".join(f"{k}_temp_path {tmp};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (tmp / "nginx.conf").write_text(
            f"load_module {ECHO_MODULE};\nuser root;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\ndaemon off;\n"
            f"worker_processes 2;\nevents {{ worker_connections 4096; }}\n"
            f"http {{ log_format body '$body_bytes_sent'; access_log {tmp}/served.log body; {temp}\n"
            "  keepalive_requests 100000;\n"
            f"  split_clients $request_id $fault {{ {faults}* 0; }}\n"
            f"  server {{ listen {self.storage_ip}:80;\n"
            f"    location / {{ if ($fault = 503) {{ return 503 '{SLOW_DOWN}'; }} if ($fault = 444) {{ return 444; }}\n"
            f"      {delay}echo_exec @file; }}\n"
            f"    {serve} }} }}\n"
        )
        self._procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", self.ns("s"), "nginx", "-c", str(tmp / "nginx.conf")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for _ in range(100):  # until it answers
            probe = self.run_on("s", ["bash", "-c", f"exec 3<>/dev/tcp/{self.storage_ip}/80"], timeout=5)
            if probe.returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"nginx did not start: {(tmp / 'error.log').read_text()[-2000:]}")

    # --- running things
    def run_on(self, host: str, argv: Sequence[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """`argv` inside `host`'s namespace ("s", "n0", ...), to completion or `timeout` seconds."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *argv], timeout=timeout, capture_output=True, text=True, **kwargs
        )

    def start(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """`argv` started inside node `node`'s namespace; killed, at the latest, when the `with` ends."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.node(node), *argv], text=True, **kwargs)
        self._procs.append(proc)
        return proc

    def served(self) -> int:
        """Bytes of response bodies the store has sent so far (its access log: requests that ended)."""
        assert self._tmp is not None
        log = Path(self._tmp.name) / "served.log"
        return sum(int(n) for n in log.read_text().split()) if log.exists() else 0


def _ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)


def _rate(ns: str, dev: str, mbit: float) -> None:
    """Cap what `dev` sends at `mbit` Mbit/s (htb: one class for everything)."""
    _run_tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    _run_tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{mbit}mbit",
            "ceil", f"{mbit}mbit")  # fmt: skip


def _run_tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True)


def _kill_in(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
