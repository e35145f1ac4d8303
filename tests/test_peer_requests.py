"""Requests to peers against a hostile one: a raw socket server on 127.0.0.1 (a thread a connection) that
answers as each test's script says (dripped headers, slow or endless error bodies, a 404 announcing a
petabyte, chunked answers, 503 then a good answer, a garbage status line, a reset, 403, TLS), and otherwise
serves the real files' bytes with the right ETag. Every load is compared bit for bit with safetensors' own,
the peer is named by one warning, the load ends within a bound a hang could not meet, and the peer's
connections are all closed by the client after it (their threads end on their own)."""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

import streamload
from streamload.servers.seed import Seeder
from streamload.storage import peer_proof
from streamload.storage.cache import version_of
from streamload.storage.peers import url_path, version_tag
from streamload.storage.remote import ObjectPath

from .test_peers import Store, assert_same, sent, store, warnings_of

__all__ = ["store"]  # the module's fixture, shared: one store and seeded cache for this module

HANG = 40.0  # s: the most any misbehaviour goes on (a client that waits for it fails the bound, not the suite)
BOUND = 15.0  # s: a load with one hostile peer (STREAMLOAD_PEER_TIMEOUT=1) ends within this: not a hang
DRIP = 0.4  # s between the bytes a dripping peer sends: under the timeout, so only a whole-request bound helps


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "1")
    monkeypatch.setenv("STREAMLOAD_RETRIES", "2")
    for name in ("STREAMLOAD_PEERS_UNVERIFIED", "STREAMLOAD_PEER_TOKEN", "STREAMLOAD_PEER_TOKEN_FILE",
                 "STREAMLOAD_PEER_CA"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


class File(NamedTuple):
    data: bytes
    tag: str
    prefix: bytes  # the bytes before the data section (the proof's key is made of them)


@pytest.fixture(scope="module")
def files(store: Store) -> dict[str, File]:
    """{the URL path a peer serves it at: the file} for the store's model."""
    out = {}
    for copy in store.copies():
        url = f"{store.url}{copy.name}"
        header = streamload.inspect(url).files[0]
        data = copy.read_bytes()
        out[url_path(ObjectPath(url))] = File(data, version_tag(version_of(header)), data[: header.data_start])
    return out


class Asked(NamedTuple):
    method: str
    target: str
    headers: dict[str, str]  # names in lower case
    n: int  # the how-many-th request of its method this is (from 1)


Script = Callable[[Asked], str]  # the answer (an action's name) to each request


def first(action: str, method: str = "GET", times: int = 1) -> Script:
    """`action` for the first `times` requests of `method`, good answers otherwise."""
    return lambda asked: action if asked.method == method and asked.n <= times else "good"


class HostilePeer:
    """A peer on 127.0.0.1 answering each request as `script` says (see `_act`), serving `files` where it
    answers well; TLS where `tls` is given. `requests`: what it was asked. Stopped by `close`, which
    ends every thread and socket it started."""

    def __init__(self, files: dict[str, File], script: Script, tls: ssl.SSLContext | None = None,
                 handshake: bytes | None = None) -> None:  # fmt: skip
        self.files, self.script, self.tls, self.handshake = files, script, tls, handshake
        self.requests: list[Asked] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"{'https' if tls or handshake else 'http'}://127.0.0.1:{self.listener.getsockname()[1]}"
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    # -- the server ---------------------------------------------------------------------------------------
    def _accept(self) -> None:
        self.listener.settimeout(0.1)  # a closed listener does not wake a blocked accept: polled
        while not self._done.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(HANG)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._conns.append(conn)
                self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        began = time.monotonic()
        try:
            if self.handshake is not None:  # a TLS server's first flight, dripped
                conn.recv(65536)
                self._drip(conn, self.handshake)
                return
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.append(conn)
            buffer = b""
            while not self._done.is_set() and time.monotonic() - began < HANG:
                while b"\r\n\r\n" not in buffer:
                    more = conn.recv(65536)
                    if not more:
                        return
                    buffer += more
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                line, *fields = head.decode("latin-1").split("\r\n")
                method, target, _ = line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
                with self._lock:
                    n = self._counts[method] = self._counts.get(method, 0) + 1
                    asked = Asked(method, target, headers, n)
                    self.requests.append(asked)
                if not self._act(self.script(asked), conn, asked):
                    return
        except (OSError, ValueError):
            return  # the client went away (or sent what this server does not parse): this connection ends
        finally:
            conn.close()

    def _act(self, action: str, conn: socket.socket, asked: Asked) -> bool:
        """Answer `asked` as `action` says; whether the connection takes another request."""
        if action == "good":
            return self._good(conn, asked)
        if action == "drip":  # a good answer's headers, a byte at a time
            self._drip(conn, self._head(asked))
        elif action == "slow-500":  # an error whose body comes a byte at a time
            conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\n")
            self._drip(conn, b"x" * 100)
        elif action == "slow-412":
            conn.sendall(b"HTTP/1.1 412 Precondition Failed\r\nContent-Length: 100\r\n\r\n")
            self._drip(conn, b"x" * 100)
        elif action == "endless-404":  # a chunked error body that never ends (a chunk well within the timeout)
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n")
            until = time.monotonic() + HANG
            while not self._done.wait(DRIP) and time.monotonic() < until:
                conn.sendall(b"1\r\nx\r\n")
        elif action == "huge-404":  # an error announcing a petabyte of body
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % 10**15 + b"x" * 1000)
            self._hold(conn)
        elif action == "chunked-206":  # the right bytes and headers, but chunked
            head = self._head(asked).replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            body = self._body(asked)
            conn.sendall(head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
            return True
        elif action == "off-range":  # a 206 one byte off the range asked for, the right length
            head = re.sub(rb"bytes (\d+)-(\d+)/", lambda m: b"bytes %d-%d/" % (int(m[1]) + 1, int(m[2]) + 1),
                          self._head(asked))  # fmt: skip
            conn.sendall(head + self._body(asked))
            return True
        elif action == "busy":
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 4\r\n"
                         b"Connection: close\r\n\r\nbusy")  # fmt: skip
        elif action == "forbidden":
            conn.sendall(b"HTTP/1.1 403 no proof of reading the origin\r\nContent-Length: 0\r\n\r\n")
            return True
        elif action == "garbage":
            conn.sendall(b"HTTP/1.1 2x6 Partial Content\r\n\r\n")
        elif action == "reset":  # the right headers, then a reset
            conn.sendall(self._head(asked))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            raise AssertionError(action)
        return False

    def _drip(self, conn: socket.socket, data: bytes) -> None:
        """`data` a byte at a time (for `HANG` s at most), then wait for the client to close."""
        until = time.monotonic() + HANG
        for k in range(len(data)):
            if self._done.wait(DRIP) or time.monotonic() > until:
                return
            conn.sendall(data[k : k + 1])
        self._hold(conn)

    def _hold(self, conn: socket.socket) -> None:
        """Wait (`HANG` s at most) for the client to close the connection, reading what it sends."""
        while conn.recv(65536):
            pass

    def _head(self, asked: Asked) -> bytes:
        """The headers of a good answer to `asked` (200 to a HEAD, 206 to a GET with a Range)."""
        file = self.files.get(asked.target)
        if file is None:
            return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        if asked.headers.get("if-match") != file.tag:
            return b"HTTP/1.1 412 Precondition Failed\r\nContent-Length: 0\r\n\r\n"
        fields = f"ETag: {file.tag}\r\nAccept-Ranges: bytes\r\n"
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", asked.headers.get("range", ""))
        if asked.method == "GET" and wanted:
            a, b = int(wanted[1]), min(int(wanted[2]), len(file.data) - 1)
            return (f"HTTP/1.1 206 Partial Content\r\n{fields}Content-Length: {b - a + 1}\r\n"
                    f"Content-Range: bytes {a}-{b}/{len(file.data)}\r\n\r\n").encode()  # fmt: skip
        return f"HTTP/1.1 200 OK\r\n{fields}Content-Length: {len(file.data)}\r\n\r\n".encode()

    def _body(self, asked: Asked) -> bytes:
        file = self.files.get(asked.target)
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", asked.headers.get("range", ""))
        if file is None or asked.method != "GET" or asked.headers.get("if-match") != file.tag:
            return b""
        return file.data[int(wanted[1]) : int(wanted[2]) + 1] if wanted else file.data

    def _good(self, conn: socket.socket, asked: Asked) -> bool:
        conn.sendall(self._head(asked) + self._body(asked))
        return True

    # -- the test's side ----------------------------------------------------------------------------------
    def served(self) -> int:
        """How many good answers to a GET it gave."""
        return sum(1 for a in self.requests if a.method == "GET" and self.script(a) == "good")

    def settled(self, within: float = 10.0) -> list[threading.Thread]:
        """The connection threads still running after waiting up to `within` s for the client to close its ends."""
        deadline = time.monotonic() + within
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self.threads if t.is_alive()]

    def close(self) -> None:
        self._done.set()
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._accepting.join(5)
        for thread in self.threads:
            thread.join(5)


@contextmanager
def hostile(files: dict[str, File], script: Script, tls: ssl.SSLContext | None = None,
            handshake: bytes | None = None) -> Iterator[HostilePeer]:  # fmt: skip
    peer = HostilePeer(files, script, tls, handshake)
    try:
        yield peer
    finally:
        peer.close()
        assert not peer._accepting.is_alive() and not any(t.is_alive() for t in peer.threads)
        assert peer.listener.fileno() == -1 and all(c.fileno() == -1 for c in peer._conns)


def load(store: Store, peers: list[str], tmp_path: Path) -> tuple[dict, float]:
    """A load of the store's model with `peers` (its time); the client's threads for peers ended after it."""
    began = time.monotonic()
    got = streamload.load(store.url, device="cpu", peers=peers, chunk_bytes="1MiB", cache_dir=tmp_path / "c")
    took = time.monotonic() - began
    assert not [t.name for t in threading.enumerate() if t.name.startswith("streamload-peers")]
    return got, took


def assert_left_alone(peer: HostilePeer) -> None:
    """The client closed every connection it opened to `peer` (each of its threads ended on its own)."""
    assert not peer.settled(), "the client left connections to the peer open"


# -- one hostile peer at a time ----------------------------------------------------------------------------
HOSTILE = [  # (script, what its one warning says)
    pytest.param(first("drip", "HEAD"), "did not answer within 1 s", id="headers-dripped-to-a-HEAD"),
    pytest.param(first("drip"), "did not answer within", id="headers-dripped-to-a-GET"),
    pytest.param(first("slow-500"), "answered 500", id="500-with-a-slow-body"),
    pytest.param(first("slow-412"), "holds another version", id="412-with-a-slow-body"),
    pytest.param(first("endless-404"), "does not hold", id="404-with-an-endless-chunked-body"),
    pytest.param(first("huge-404"), "does not hold", id="404-announcing-a-petabyte"),
    pytest.param(first("chunked-206"), "chunked", id="206-chunked"),
    pytest.param(first("off-range"), "Content-Range", id="206-off-the-range-asked"),
    pytest.param(first("garbage"), "dropped", id="garbage-status-line"),
    pytest.param(first("reset"), "dropped", id="reset-after-headers"),
    pytest.param(lambda asked: "busy", "503", id="503-for-ever"),
]


@pytest.mark.parametrize(("script", "said"), HOSTILE)
def test_a_hostile_peer_one_warning_and_the_load_exact(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture, script: Script, said: str
) -> None:
    with hostile(files, script) as peer:
        got, took = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    assert took < BOUND, took
    mine = [w for w in warnings_of(caplog) if peer.url in w]
    assert len(mine) == 1 and said in mine[0], warnings_of(caplog)


def test_503_with_retry_after_is_retried_not_dropped(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def script(asked: Asked) -> str:  # the first HEAD and the first two GETs: busy (a seeder at its cap)
        return "busy" if asked.n <= (1 if asked.method == "HEAD" else 2) else "good"

    before = sent(store)
    with hostile(files, script) as peer:
        got, took = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    assert not warnings_of(caplog) and took < BOUND, (warnings_of(caplog), took)
    assert sent(store) == before  # every tensor byte from the peer, once it could take the requests
    assert [a.method for a in peer.requests].count("HEAD") == len(files)  # a busy HEAD: its GETs say


def test_a_busy_peer_leaves_its_ranges_to_another(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with hostile(files, lambda asked: "busy" if asked.method == "GET" else "good") as busy, \
         hostile(files, lambda asked: "good") as good:  # fmt: skip
        before = sent(store)
        got, took = load(store, [busy.url, good.url], tmp_path)
        assert_left_alone(busy)
        assert_left_alone(good)
    assert_same(got, store.www / "model")
    assert sent(store) == before and good.served() > 0 and took < BOUND
    assert [w for w in warnings_of(caplog) if good.url in w] == []


# -- proof of reading --------------------------------------------------------------------------------------
def test_every_request_carries_a_proof_of_reading(
    store: Store, files: dict[str, File], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMLOAD_PEER_TOKEN", "s3cret")
    with hostile(files, lambda asked: "good") as peer:
        got, _ = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    assert {a.method for a in peer.requests} == {"HEAD", "GET"}
    proofs = peer_proof.Proofs()
    for asked in peer.requests:
        file = files[asked.target]
        key = peer_proof.read_key(file.prefix, file.tag, b"s3cret")
        value = asked.headers.get(peer_proof.HEADER.lower())
        why = proofs.check(key, value, asked.method, asked.target, asked.headers.get("range", ""))
        assert why is None, (why, asked)
        wrong = peer_proof.read_key(file.prefix, file.tag, b"another")
        assert peer_proof.Proofs().check(wrong, value, asked.method, asked.target, asked.headers.get("range", ""))


def test_a_peer_refusing_us_says_to_set_the_token(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with hostile(files, lambda asked: "forbidden") as peer:
        got, took = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    mine = [w for w in warnings_of(caplog) if peer.url in w]
    assert len(mine) == 1 and "refused" in mine[0] and "STREAMLOAD_PEER_TOKEN" in mine[0], warnings_of(caplog)
    assert {a.method for a in peer.requests} == {"HEAD"} and took < BOUND  # not asked for a range of any file


@pytest.mark.parametrize("content", [None, "\n"], ids=["missing", "empty"])
def test_a_bad_token_file_fails_the_load_at_its_start(
    store: Store, files: dict[str, File], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None
) -> None:
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    monkeypatch.setenv("STREAMLOAD_PEER_TOKEN_FILE", str(token))
    with hostile(files, lambda asked: "good") as peer:
        with pytest.raises(ValueError, match=re.escape(str(token))):
            load(store, [peer.url], tmp_path)
        assert peer.requests == []


# -- https peers -------------------------------------------------------------------------------------------
class Certificates(NamedTuple):
    ca: Path  # the CA's certificate (PEM)
    pem: Path  # the certificate naming 127.0.0.1 and its key (PEM), as a seeder serves TLS with
    good: ssl.SSLContext  # a server context whose certificate names 127.0.0.1, signed by the CA
    by_name: ssl.SSLContext  # one whose certificate names localhost alone
    misnamed: ssl.SSLContext  # one whose certificate, signed by the CA, names another host only


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)
    hour = datetime.timedelta(hours=1)

    def made(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ca: bool, names: list[x509.GeneralName]) -> x509.Certificate:  # fmt: skip
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - hour).not_valid_after(now + 24 * hour)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamload test CA")])
    ca = made("streamload test CA", ca_key, ca_name, ca_key, True, [])
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def context(name: str, names: list[x509.GeneralName]) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = made(name, key, ca_name, ca_key, False, names)
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
        out = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        out.load_cert_chain(folder / f"{name}.pem")
        return out

    good = context("peer", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    by_name = context("localhost", [x509.DNSName("localhost")])
    misnamed = context("other", [x509.DNSName("other.example")])
    return Certificates(folder / "ca.pem", folder / "peer.pem", good, by_name, misnamed)


def test_an_https_peer_verified_with_the_ca_file(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    certificates: Certificates, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("STREAMLOAD_PEER_CA", str(certificates.ca))
    before = sent(store)
    with hostile(files, lambda asked: "good", tls=certificates.good) as peer:
        got, _ = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    assert sent(store) == before and peer.served() > 0 and not warnings_of(caplog)


def test_an_https_peer_named_is_verified_for_its_name_at_its_address(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    certificates: Certificates, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("STREAMLOAD_PEER_CA", str(certificates.ca))
    before = sent(store)
    with hostile(files, lambda asked: "good", tls=certificates.by_name) as peer:
        port = peer.url.rsplit(":", 1)[1]
        got, _ = load(store, [f"https://localhost:{port}"], tmp_path)  # its certificate names localhost alone
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    assert sent(store) == before and peer.served() > 0
    assert not [w for w in warnings_of(caplog) if f"127.0.0.1:{port}" in w], warnings_of(caplog)


@pytest.mark.parametrize("case", ["unknown-ca", "another-name"])
def test_an_https_peer_whose_certificate_fails_is_dropped(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    certificates: Certificates, monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:  # fmt: skip
    if case == "another-name":
        monkeypatch.setenv("STREAMLOAD_PEER_CA", str(certificates.ca))
    tls = certificates.good if case == "unknown-ca" else certificates.misnamed  # unknown: the system's store
    with hostile(files, lambda asked: "good", tls=tls) as peer:
        got, took = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    mine = [w for w in warnings_of(caplog) if peer.url in w]
    assert len(mine) == 1 and "certificate" in mine[0] and "dropped" in mine[0], warnings_of(caplog)
    assert peer.requests == [] and took < BOUND


def test_an_https_peer_dripping_its_handshake(
    store: Store, files: dict[str, File], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server_hello = b"\x16\x03\x03\x00\x40" + bytes(64)  # a handshake record's header, then its bytes slowly
    with hostile(files, lambda asked: "good", handshake=server_hello) as peer:
        got, took = load(store, [peer.url], tmp_path)
        assert_left_alone(peer)
    assert_same(got, store.www / "model")
    mine = [w for w in warnings_of(caplog) if peer.url in w]
    assert len(mine) == 1 and "did not answer within 1 s" in mine[0], warnings_of(caplog)
    assert took < BOUND


def test_a_bad_ca_file_fails_the_load_at_its_start(
    store: Store, files: dict[str, File], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    certificates: Certificates,
) -> None:  # fmt: skip
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    monkeypatch.setenv("STREAMLOAD_PEER_CA", str(tmp_path / "ca.pem"))
    with hostile(files, lambda asked: "good", tls=certificates.good) as peer:
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / "ca.pem"))):
            load(store, [peer.url], tmp_path)


# -- a seeder ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours", ["s3cret", "another"])
def test_a_tls_seeder_with_a_token(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, certificates: Certificates,
    monkeypatch: pytest.MonkeyPatch, ours: str,
) -> None:  # fmt: skip
    (tmp_path / "token").write_text("s3cret\n")
    monkeypatch.setenv("STREAMLOAD_PEER_CA", str(certificates.ca))
    monkeypatch.setenv("STREAMLOAD_PEER_TOKEN", ours)
    before = sent(store)
    seeder = Seeder(store.seeded, "127.0.0.1", 0, token_file=tmp_path / "token", cert=certificates.pem,
                    key=certificates.pem).start()  # fmt: skip
    try:
        assert seeder.url.startswith("https://")
        got, took = load(store, [seeder.url], tmp_path)
    finally:
        seeder.close()
    assert_same(got, store.www / "model")
    mine = [w for w in warnings_of(caplog) if seeder.url in w]
    if ours == "s3cret":
        assert sent(store) == before and seeder.sent > 0 and not warnings_of(caplog), warnings_of(caplog)
    else:  # refused: said once, the load from the store
        assert len(mine) == 1 and "refused us" in mine[0] and "STREAMLOAD_PEER_TOKEN" in mine[0], warnings_of(caplog)
        assert seeder.sent == 0 and sent(store) > before and took < BOUND


def test_retry_after_is_bounded() -> None:
    from email.utils import formatdate

    from streamload.storage.peers import RETRY_CAP, RETRY_FLOOR, _retry_after

    assert _retry_after("1") == 1.0 and _retry_after(None) == 1.0 and _retry_after("soon") == 1.0
    assert _retry_after("0") == RETRY_FLOOR and _retry_after("86400") == RETRY_CAP
    assert _retry_after("9" * 400) == RETRY_CAP
    assert _retry_after("\u00b2") == 1.0  # a digit to str.isdigit, not to float
    assert _retry_after(formatdate(time.time() - 60, usegmt=True)) == RETRY_FLOOR
    assert _retry_after(formatdate(time.time() + 3600, usegmt=True)) == RETRY_CAP


def test_a_peer_slower_than_the_source_loses_its_ranges_within_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeder trickling 20 kB/s, with the load's timeout at its default (5 s, a second per MB on top): the
    peer is dropped once a range takes it longer than the source would need (about a second here), not
    after its whole deadline, and the source serves the rest."""
    from .test_peers import own_store, seeders

    monkeypatch.delenv("STREAMLOAD_PEER_TIMEOUT", raising=False)  # the default: 1 s would hide it
    for mine in own_store(tmp_path):
        with seeders(mine.seeded, rate=20e3) as (trickle,):
            began = time.monotonic()
            got = streamload.load(mine.url, device="cpu", peers=[trickle.url])
            took = time.monotonic() - began
        assert_same(got, mine.www / "model")
        said = [w for w in warnings_of(caplog) if trickle.url in w]
        assert len(said) == 1 and "slower than the source" in said[0], warnings_of(caplog)
        assert took < 5, took  # dropped within about a second; its deadline alone: 5 s + a second per MB
