"""A small async server that answers health checks at once and serves as soon as its model is in.

The model loads in the background with `aload_into`; each layer is warmed up in `on_layer` while
later layers still load. `GET /health` reports per-layer readiness from the first millisecond;
`GET /generate` waits for the model to be complete, then runs it. With `--self-test` (the default
when run as a script) the example starts the server on 127.0.0.1, polls it as a client would, sends
one request, prints the timeline (every event in time order) and stops.

    python examples/server_warmup.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import anyio
import torch
from anyio.abc import SocketStream
from torch import nn

import streamload


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, d: int = 512, n: int = 12, vocab: int = 8000) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


class Server:
    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        with torch.device("meta"):
            self.model = Model()
        self.started = time.perf_counter()
        self.ready_layers: dict[str, float] = {}
        self.complete = anyio.Event()
        self.timeline: list[tuple[float, str]] = []  # (ms since start, what happened), printed sorted

    def log(self, what: str) -> None:
        self.timeline.append((1e3 * (time.perf_counter() - self.started), what))

    async def load(self) -> None:
        def warm(key: str, layer: nn.Module | None) -> None:
            assert layer is not None
            with torch.no_grad():
                layer(torch.zeros(1, 16, 512))  # first-call costs paid now, not on the first request
            self.ready_layers[key] = time.perf_counter() - self.started
            self.log(f"{key} loaded and warmed up")

        await streamload.aload_into(self.model, self.checkpoint, device="cpu", on_layer=warm)
        self.complete.set()

    async def handle(self, client: SocketStream) -> None:
        async with client:
            request = (await client.receive(65536)).decode(errors="replace")
            path = request.split(" ", 2)[1] if request.count(" ") >= 2 else "/"
            if path == "/health":
                body = {"ready": self.complete.is_set(), "layers_ready": len(self.ready_layers),
                        "layers": len(self.model.layers)}  # fmt: skip
            elif path == "/generate":
                await self.complete.wait()
                with torch.no_grad():
                    logits = self.model(torch.arange(16).reshape(1, 16))
                body = {"next_token": int(logits[0, -1].argmax())}
            else:
                body = {"error": "not found"}
            data = json.dumps(body).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\nContent-Type: application/json\r\n\r\n"
            await client.send(head.encode() + data)


async def get(port: int, path: str) -> dict:
    """One HTTP request; the server closes the connection after its answer."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        chunks = []
        try:
            while True:
                chunks.append(await stream.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    return json.loads(b"".join(chunks).split(b"\r\n\r\n", 1)[1])


async def self_test(checkpoint: Path) -> None:
    server = Server(checkpoint)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server.handle)
        tg.start_soon(server.load)
        server.log(f"health: {await get(port, '/health')}")
        for _ in range(2000):  # bounded polling, as a load balancer would
            health = await get(port, "/health")
            if health["ready"]:
                server.log(f"health: {health}")
                break
            await anyio.sleep(0.005)
        server.log(f"first request served: {await get(port, '/generate')}")
        tg.cancel_scope.cancel()
    for at, what in sorted(server.timeline):
        print(f"{at:7.1f} ms  {what}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory(prefix="streamload-server-") as tmp:
        from safetensors.torch import save_file

        torch.manual_seed(0)
        state = {k: v.contiguous() for k, v in Model().state_dict().items()}
        save_file(state, Path(tmp) / "model.safetensors")
        anyio.run(self_test, Path(tmp))


if __name__ == "__main__":
    main()
