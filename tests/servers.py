"""Real servers for the remote-storage tests: an HTTP server with Range and ETag support and injectable
faults, and moto's S3 server, both on 127.0.0.1."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# A fault applies to the next data request (a GET with a Range past the first 256 KiB, i.e. not a
# header read): "503" answers 503 SlowDown, "reset" sends half the body and drops the connection,
# "stall:S" waits S seconds before answering, "range" answers 206 with a Content-Range one byte off the
# range asked for (a server, or a cache in front of it, that misbehaves).
Fault = str


class RangeServer:
    """Serves a directory over HTTP with `Range`, `ETag` and `If-Match`, like nginx or a CDN; or
    without Range support at all (`ranges=False`, like `python -m http.server`), or with Last-Modified
    but no ETag (`etags=False`), a weak ETag (`weak=True`, `W/"..."`, never matching `If-Match`, as RFC 9110
    compares it strongly), or without Last-Modified (`last_modified=False`). `on_request(n)` runs before the
    n-th request (from 1) is served, with no response being read meanwhile (as a server sending each
    response from one open file sees a file replaced by rename): a test replaces objects there.
    `If-Unmodified-Since` is honoured (412), as nginx does."""

    def __init__(
        self, root: Path, ranges: bool = True, etags: bool = True, rate: float | None = None,
        connections: int | None = None, weak: bool = False, last_modified: bool = True,
        on_request: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.root, self.ranges, self.etags = root, ranges, etags
        self.weak, self.last_modified, self.on_request = weak, last_modified, on_request
        self._files = threading.Lock()  # held by on_request and by each response's stat and read
        self.authorizations: list[str] = []  # the Authorization header of each request that had one
        self.rate = rate  # bytes a second, per response (a store capped per connection); None: as fast as it goes
        # At most this many connections open at once: one more is accepted and closed unanswered, as
        # nginx does with its `worker_connections` used up ("error sending request" at the client).
        self.connections = connections
        self.open = 0
        self.refused = 0
        self.sent = 0  # body bytes of data requests sent
        self.faults: list[Fault] = []
        self.closing = threading.Event()  # set by close(): a stalled answer ends then, unanswered
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.arrived: list[float] = []  # time.time() of each request
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                wanted = self.headers.get("Range")
                if server.on_request is None:
                    self._answer(body, wanted)
                    return
                with server._files:
                    server.on_request(len(server.requests) + 1)
                    self._answer(body, wanted)

            def _answer(self, body: bool, wanted: str | None) -> None:
                if self.headers.get("Authorization"):
                    server.authorizations.append(self.headers["Authorization"])
                server.requests.append((self.command, self.path, wanted))
                server.arrived.append(time.time())
                file = server.root / self.path.lstrip("/").split("?")[0]
                if not file.is_file():
                    self._status(404)
                    return
                st = file.stat()
                etag = f'{"W/" if server.weak else ""}"{st.st_mtime_ns:x}-{st.st_size:x}"'
                if server.etags and self.headers.get("If-Match") not in (None, "*", *([] if server.weak else [etag])):
                    self._status(412)
                    return
                since = self.headers.get("If-Unmodified-Since")
                if since and server.last_modified and int(st.st_mtime) > parsedate_to_datetime(since).timestamp():
                    self._status(412)
                    return
                start, end = 0, st.st_size
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted or "") if server.ranges else None
                if m:
                    start, end = int(m[1]), min(st.st_size, int(m[2]) + 1 if m[2] else st.st_size)
                fault = server._fault() if body and m and start >= 1 << 18 else None
                if fault == "503":
                    self._status(503, b"<Error><Code>SlowDown</Code></Error>")
                    return
                if fault and fault.startswith("stall:") and server.closing.wait(float(fault.split(":")[1])):
                    self.close_connection = True
                    return
                self.send_response(206 if m else 200)
                if server.etags:
                    self.send_header("ETag", etag)
                if server.last_modified:
                    self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
                self.send_header("Accept-Ranges", "bytes" if server.ranges else "none")
                self.send_header("Content-Length", str(end - start))
                if m:
                    off = 1 if fault == "range" else 0
                    self.send_header("Content-Range", f"bytes {start + off}-{end - 1 + off}/{st.st_size}")
                self.end_headers()
                if not body:
                    return
                with open(file, "rb") as f:
                    f.seek(start)
                    data = f.read(end - start)
                if fault == "reset":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if start >= 1 << 18:
                    with server._lock:
                        server.sent += len(data)
                try:
                    server._send(self.wfile, data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a cancelled load)
                    self.close_connection = True

            def _status(self, code: int, text: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

        class Server(ThreadingHTTPServer):
            def verify_request(self, request: Any, client_address: Any) -> bool:
                with server._lock:
                    if server.connections is not None and server.open >= server.connections:
                        server.refused += 1
                        return False  # closed at once: socketserver's shutdown_request
                    server.open += 1
                    return True

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    with server._lock:
                        server.open -= 1

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def _send(self, out: Any, data: bytes) -> None:
        if self.rate is None:
            out.write(data)
            return
        start, step = time.monotonic(), 64 << 10
        for at in range(0, len(data), step):
            out.write(data[at : at + step])
            out.flush()
            ahead = start + (at + step) / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    def _fault(self) -> Fault | None:
        with self._lock:
            return self.faults.pop(0) if self.faults else None

    def data_requests(self) -> int:
        return sum(1 for method, _, r in self.requests if method == "GET" and r and int(r[6:].split("-")[0]) >= 1 << 18)

    def close(self) -> None:
        """Stop serving; stalled answers end at once, unanswered, so that none wakes inside a later test (its
        traceback read source files while that test counted open descriptors). Connections a client keeps
        open idle end with the client."""
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def s3_server(monkeypatch: Any) -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1, the standard AWS environment pointed at it; yields a boto3 client."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    try:
        yield boto3.client("s3", endpoint_url=endpoint)
    finally:
        server.stop()


def upload(client: Any, bucket: str, prefix: str, directory: Path) -> None:
    client.create_bucket(Bucket=bucket)
    for f in sorted(directory.iterdir()):
        client.upload_file(str(f), bucket, f"{prefix}{f.name}")
