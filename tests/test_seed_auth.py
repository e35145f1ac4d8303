"""Who may read from a seeder (servers/seed.py): every GET and HEAD carries a proof of having read the object
from its origin (storage/peer_proof.py), made with the copy's header bytes, its version and, where the cluster
has one, the peers' token; over TLS where the seeder has a certificate. All on 127.0.0.1, against a cache a
load filled from tests/servers.py's RangeServer."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.format.header import FileHeader
from streamload.servers.seed import Seeder
from streamload.storage.cache import cache_path, version_of
from streamload.storage.peer_proof import HEADER, proof, read_key
from streamload.storage.peers import url_path, version_tag
from streamload.storage.remote import ObjectPath

from .servers import RangeServer

pytest.importorskip("obstore")
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cached:
    """A cache a load filled with one object's copy, and what a peer that read the object's origin knows."""

    cache: Path
    url: str  # the object at its origin
    copy: Path  # its copy in `cache`
    path: str  # the URL path a seeder serves it at
    data: bytes
    header: FileHeader  # as a load read it from the origin
    tag: str  # its version's tag

    def key(self, secret: bytes | None = None, prefix: bytes | None = None) -> bytes:
        """The key a reader of the origin makes proofs with (`prefix`: another header's, to forge one)."""
        return read_key(self.header.prefix if prefix is None else prefix, self.tag, secret)


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cached]:
    root = tmp_path_factory.mktemp("seeded")
    (root / "www" / "m").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(256, 1024, generator=g), "b": torch.randn(9, generator=g)},
              root / "www" / "m" / "model.safetensors")  # fmt: skip
    server = RangeServer(root / "www")
    try:
        url = f"{server.url}/m/model.safetensors"
        streamload.load(url, device="cpu", cache_dir=root / "cache")
        header = streamload.inspect(url).files[0]
        copy = cache_path(root / "cache", ObjectPath(url))
        yield Cached(root / "cache", url, copy, url_path(ObjectPath(url)), copy.read_bytes(), header,
                     version_tag(version_of(header)))  # fmt: skip
    finally:
        server.close()


@contextmanager
def seeding(cache: Path, **options: object) -> Iterator[Seeder]:
    seeder = Seeder(cache, "127.0.0.1", 0, **options).start()  # type: ignore[arg-type]
    try:
        yield seeder
    finally:
        seeder.close()


def ask(
    url: str, path: str, key: bytes | None = None, headers: dict[str, str] | None = None, method: str = "GET",
    context: ssl.SSLContext | None = None, timeout: float = 5,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One request on a connection of its own; with `key`, proved as a reader of the origin proves it."""
    headers = dict(headers or {})
    if key is not None:
        headers[HEADER] = proof(key, method, path, headers.get("Range", ""))
    host, port = url.split("://")[1].rsplit(":", 1)
    if url.startswith("https://"):
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, int(port), timeout=timeout,
                                                                       context=context)  # fmt: skip
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


# -- who may read ------------------------------------------------------------------------------------
def test_no_proof_gets_403_and_not_a_byte(cached: Cached) -> None:
    with seeding(cached.cache) as seeder:
        for method in ("GET", "HEAD"):
            for value in (None, "", "t=1, n=00, p=00", "nonsense"):
                headers = {"Range": "bytes=0-99"} if value is None else {"Range": "bytes=0-99", HEADER: value}
                status, got, body = ask(seeder.url, cached.path, headers=headers, method=method)
                assert (status, body, got.get("Connection")) == (403, b"", "close"), (method, value)
                assert "ETag" not in got and "Content-Range" not in got  # not even which version it holds
        status, got, body = ask(seeder.url, cached.path, headers={"If-Match": '"another"'})  # as a peer of another
        assert (status, body, "ETag" in got) == (412, b"", False)  # version is told (it is not this one), no more
        assert ask(seeder.url, cached.path, headers={"If-Match": cached.tag})[0] == 403
        assert seeder.sent == 0


def test_a_proof_made_with_another_header_gets_403(cached: Cached) -> None:
    other = bytearray(cached.header.prefix)
    other[-2] ^= 1  # one bit of the JSON header: what a co-tenant who guessed the header would have
    with seeding(cached.cache) as seeder:
        another_version = read_key(cached.header.prefix, '"x"', None)
        for key in (cached.key(prefix=bytes(other)), cached.key(prefix=b""), another_version):
            status, _, body = ask(seeder.url, cached.path, key, {"Range": "bytes=0-99"})
            assert (status, body) == (403, b"")
        assert seeder.sent == 0


def test_a_replayed_proof_gets_403(cached: Cached) -> None:
    seen = {"Range": "bytes=100-199", HEADER: proof(cached.key(), "GET", cached.path, "bytes=100-199")}
    with seeding(cached.cache) as seeder:
        status, _, body = ask(seeder.url, cached.path, headers=seen)
        assert (status, body) == (206, cached.data[100:200])
        status, got, body = ask(seeder.url, cached.path, headers=seen)  # as an observer on the path would
        assert (status, body, got.get("Connection")) == (403, b"", "close")
        assert seeder.sent == 100


def test_a_proof_for_another_request_gets_403(cached: Cached) -> None:
    key = cached.key()
    with seeding(cached.cache) as seeder:
        for method, path, span, sent_as in [
            ("GET", cached.path, "bytes=0-9", ("GET", cached.path, "bytes=0-999999")),  # a wider range
            ("HEAD", cached.path, "", ("GET", cached.path, "")),  # a HEAD's proof on a GET
            ("GET", cached.path, "bytes=0-9", ("GET", cached.path + "?x", "bytes=0-9")),  # another target
        ]:  # fmt: skip
            method2, path2, span2 = sent_as
            headers = {HEADER: proof(key, method, path, span), **({"Range": span2} if span2 else {})}
            assert ask(seeder.url, path2, headers=headers, method=method2)[0] == 403, (method, span, sent_as)
        assert seeder.sent == 0


def test_the_peers_token(cached: Cached, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("the-right-token\n")
    with seeding(cached.cache, token_file=token) as seeder:
        for key in (cached.key(), cached.key(b"a-wrong-token")):  # no token; another token
            status, _, body = ask(seeder.url, cached.path, key, {"Range": "bytes=0-99"})
            assert (status, body) == (403, b"")
        status, _, body = ask(seeder.url, cached.path, cached.key(b"the-right-token"), {"Range": "bytes=0-99"})
        assert (status, body) == (206, cached.data[:100])
    monkeypatch.setenv("STREAMLOAD_PEER_TOKEN", "from-the-environment")
    with seeding(cached.cache) as seeder:
        assert ask(seeder.url, cached.path, cached.key(), {"Range": "bytes=0-9"})[0] == 403
        assert ask(seeder.url, cached.path, cached.key(b"from-the-environment"), {"Range": "bytes=0-9"})[0] == 206
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="token file is empty"):
        Seeder(cached.cache, "127.0.0.1", 0, token_file=empty)


def test_the_right_proof_gets_exact_bytes(cached: Cached) -> None:
    key, data = cached.key(), cached.data
    with seeding(cached.cache) as seeder:
        status, got, body = ask(seeder.url, cached.path, key, {"Range": "bytes=1000-4999"})
        assert (status, body, got["ETag"], got["Content-Range"]) == (
            206, data[1000:5000], cached.tag, f"bytes 1000-4999/{len(data)}")  # fmt: skip
        assert ask(seeder.url, cached.path, key)[1:] == (ask(seeder.url, cached.path, key)[1], data)
        status, got, body = ask(seeder.url, cached.path, key, method="HEAD")
        assert (status, got["Content-Length"], body) == (200, str(len(data)), b"")
        assert ask(seeder.url, cached.path, key, {"Range": "bytes=0-0", "If-Match": '"another"'})[0] == 412
        assert ask(seeder.url, cached.path, key, {"Range": f"bytes={len(data)}-"})[0] == 416
        assert ask(seeder.url, f"{cached.path}.nothing", key)[0] == 404


# -- TLS -----------------------------------------------------------------------------------------------
def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    public = private.public_key()
    made = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(private, hashes.SHA256())
    )  # fmt: skip
    cert.write_bytes(made.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))  # fmt: skip
    return cert, key


def test_over_tls_an_https_peer_gets_the_bytes_and_a_plain_one_none(cached: Cached, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    trusting = ssl.create_default_context(cafile=str(cert))
    with seeding(cached.cache, cert=cert, key=key) as seeder:
        assert seeder.url.startswith("https://127.0.0.1:")
        status, _, body = ask(seeder.url, cached.path, cached.key(), {"Range": "bytes=10-2009"}, context=trusting)
        assert (status, body) == (206, cached.data[10:2010])
        status, _, body = ask(seeder.url, cached.path, cached.key(), {"Connection": "close"}, context=trusting)
        assert (status, body) == (200, cached.data)  # every byte, then closed
        assert ask(seeder.url, cached.path, headers={"Range": "bytes=0-9"}, context=trusting)[0] == 403
        plain = "http://" + seeder.url.split("://")[1]
        try:
            status, _, body = ask(plain, cached.path, cached.key(), {"Range": "bytes=10-2009"})
        except (OSError, http.client.HTTPException):
            pass  # the handshake it never made: closed
        else:
            assert status != 206 and cached.data[10:2010] not in body
        with pytest.raises(ssl.SSLError):  # a peer that does not trust the certificate goes no further
            ask(seeder.url, cached.path, cached.key(), context=ssl.create_default_context())
    with seeding(cached.cache, cert=cert, key=key, connections=1) as seeder:  # over the cap: 503 over TLS too
        host, port = seeder.url.split("://")[1].rsplit(":", 1)
        with trusting.wrap_socket(socket.create_connection((host, int(port)), timeout=5), server_hostname=host):
            status, got, _ = ask(seeder.url, cached.path, cached.key(), context=trusting)
            assert (status, got.get("Retry-After")) == (503, "1")
    with pytest.raises(ValueError, match=str(tmp_path / "missing.pem")):
        Seeder(cached.cache, "127.0.0.1", 0, cert=tmp_path / "missing.pem", key=key)


def test_seed_command_with_a_token_file_and_tls(cached: Cached, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    seeder = subprocess.Popen(
        [sys.executable, "-m", "streamload", "seed", "--cache-dir", str(cached.cache), "--host", "127.0.0.1", "--port",
         "0", "--token-file", str(token), "--cert", str(cert), "--key", str(key)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert seeder.stdout is not None
        line = seeder.stdout.readline()
        url = next((w for w in line.split() if w.startswith("https://")), None)
        assert url is not None, line
        trusting = ssl.create_default_context(cafile=str(cert))
        assert ask(url, cached.path, cached.key(), {"Range": "bytes=0-9"}, context=trusting)[0] == 403
        status, _, body = ask(url, cached.path, cached.key(b"s3cret"), {"Range": "bytes=0-9"}, context=trusting)
        assert (status, body) == (206, cached.data[:10])
        seeder.send_signal(signal.SIGTERM)
        assert seeder.wait(30) == 0
    finally:
        seeder.kill()
        seeder.communicate()  # its pipes closed
    done = subprocess.run([sys.executable, "-m", "streamload", "seed", "--cache-dir", str(cached.cache), "--port",
                           "0", "--cert", str(tmp_path / "nope.pem"), "--key", str(key)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 1 and "nope.pem" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_vllm_seed_option_passes_token_and_tls(cached: Cached, tmp_path: Path) -> None:
    from streamload.integrations.vllm.options import check_options
    from streamload.integrations.vllm.seeding import start

    cert, key = self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    spec = {"host": "127.0.0.1", "port": 0, "token_file": str(token), "cert": str(cert), "key": str(key)}
    assert check_options({"seed": spec, "cache_dir": str(cached.cache)})["seed"] == spec
    with pytest.raises(ValueError, match="seed\\['cert'\\] must be"):
        check_options({"seed": {"cert": 1}, "cache_dir": "/c"})
    model = torch.nn.Linear(2, 2)
    url, _ = start({"seed": spec, "cache_dir": str(cached.cache)}, model)
    try:
        assert url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=str(cert))
        status, _, body = ask(url, cached.path, cached.key(b"s3cret"), {"Range": "bytes=0-9"}, context=trusting)
        assert (status, body) == (206, cached.data[:10])
    finally:
        del model
        import gc

        gc.collect()


def test_records_name_the_version_a_proof_is_made_for(cached: Cached) -> None:
    """The seeder's tag is the record's: the same a reader of the origin computes from its header."""
    record = json.loads(cached.copy.with_name(cached.copy.name + ".streamload.json").read_text())
    assert version_tag(record) == cached.tag


def test_serve_seed_passes_the_token_and_tls_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from streamload.commands.cli import main

    ran = tmp_path / "ran"
    touch = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    cache = ["--cache-dir", str(tmp_path / "c")]
    assert main(["serve", "--seed-cert", str(tmp_path / "cert.pem"), *cache, *touch]) == 1
    assert "go with --seed" in capsys.readouterr().err
    missing = tmp_path / "nope.pem"
    assert main(["serve", "--seed", "127.0.0.1:0", "--seed-cert", str(missing), *cache, *touch]) == 1
    assert str(missing) in capsys.readouterr().err  # the Seeder was given it, and said which file
    assert main(["serve", "--seed", "127.0.0.1:0", "--seed-token-file", str(missing), *cache, *touch]) == 1
    assert f"{missing}: cannot read the peers' token" in capsys.readouterr().err
    assert not ran.exists()  # checked before the server starts
