"""Hugging Face hub ids (storage/hub.py), against a stand-in for the hub on 127.0.0.1: its resolve URLs
(`/{repo}/resolve/{revision}/{file}`, with the headers huggingface_hub reads: X-Repo-Commit, ETag,
X-Linked-Etag, X-Linked-Size, X-Error-Code) and, for LFS files, a 302 to a second server standing for the
CDN (another origin, as the hub's is), which serves ranges. The hub cache is a folder of the test's
(HF_HOME and huggingface_hub's constants, which it reads at import, both pointed there)."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.base.errors import MissingFileError, SourceError, StreamloadError

huggingface_hub = pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")

REPO = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_stand_in_token"


class StandIn:
    """The hub's resolve URLs (one repo, branch main at COMMIT) and a CDN serving its LFS blobs by SHA-256."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.lfs = {n: hashlib.sha256(b).hexdigest() for n, b in files.items() if n.endswith(".safetensors")}
        self.blobs = {sha: files[n] for n, sha in self.lfs.items()}
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # (server, path, Range, Authorization)
        self.sent = 0  # bytes of blobs sent by the CDN
        self.cut: dict[str, int] = {}  # blob -> bytes after which its next GET is cut off, then it answers 500
        self.failing: set[str] = set()
        self.held: dict[str, tuple[int, threading.Event]] = {}  # blob -> bytes sent before waiting for the event
        self._lock = threading.Lock()
        self.hub = self._server("hub")
        self.cdn = self._server("cdn")
        self.endpoint = f"http://127.0.0.1:{self.hub.server_port}"

    def _server(self, role: str) -> ThreadingHTTPServer:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                stand_in._answer(self, role, body=False)

            def do_GET(self) -> None:
                stand_in._answer(self, role, body=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=f"stand-in {role}", daemon=True).start()
        return server

    def close(self) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    def hub_requests(self) -> list[str]:
        return [path for server, path, _, _ in self.requests if server == "hub"]

    def _answer(self, h: BaseHTTPRequestHandler, role: str, body: bool) -> None:
        with self._lock:
            self.requests.append((role, h.path, h.headers.get("Range"), h.headers.get("Authorization")))
        if role == "cdn":
            self._blob(h, body)
            return
        found = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", h.path)
        if found is None or found["repo"] != REPO:
            return _status(h, 404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        if found["rev"] not in ("main", COMMIT):
            return _status(h, 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"})
        name = found["file"]
        if name not in self.files:
            return _status(h, 404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                                    "X-Repo-Commit": COMMIT})  # fmt: skip
        data = self.files[name]
        if name in self.lfs:  # the hub redirects an LFS file to its CDN, saying what the CDN will serve
            sha = self.lfs[name]
            cdn = f"http://127.0.0.1:{self.cdn.server_port}/blobs/{sha}"
            return _status(h, 302, {"Location": cdn, "X-Repo-Commit": COMMIT, "ETag": '"0a1b2c"',
                                    "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))})  # fmt: skip
        git = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
        h.send_response(200)
        for key, value in {"X-Repo-Commit": COMMIT, "ETag": f'"{git}"', "Content-Length": str(len(data))}.items():
            h.send_header(key, value)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _blob(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        sha = h.path.rsplit("/", 1)[-1]
        data = self.blobs.get(sha)
        if data is None:
            return _status(h, 404)
        if body and sha in self.failing:
            return _status(h, 500)
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range") or "")
        start, end = (int(wanted[1]), int(wanted[2]) + 1 if wanted[2] else len(data)) if wanted else (0, len(data))
        h.send_response(206 if wanted else 200)
        h.send_header("ETag", f'"{sha}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(end - start))
        if wanted:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        held = self.held.pop(sha, None)
        if held is not None:  # a slow CDN: the rest comes once the test has seen what the load did meanwhile
            h.wfile.write(data[start : start + held[0]])
            h.wfile.flush()
            held[1].wait(30)
            start += held[0]
        cut = self.cut.pop(sha, None)
        part = data[start:end] if cut is None else data[start : start + cut]
        with self._lock:
            self.sent += len(part)
        h.wfile.write(part)
        if cut is not None:  # the connection drops mid-file; the CDN fails from then on
            self.failing.add(sha)
            h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)
            h.close_connection = True


def _status(h: BaseHTTPRequestHandler, code: int, headers: dict[str, str] | None = None) -> None:
    h.send_response(code)
    for key, value in (headers or {}).items():
        h.send_header(key, value)
    h.send_header("Content-Length", "0")
    h.end_headers()


def _checkpoint(folder: Path) -> dict[str, bytes]:
    """Two shards (about 1.5 MiB each), an index and a config, as a repo on the hub holds them."""
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {f"model.layers.{shard * 10 + i}.weight": torch.randn(96, 1024, generator=generator)
                   for i in range(4)}  # fmt: skip
        save_file(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    """The stand-in, online; the hub cache, the token and the endpoint all the test's own."""
    home = tmp_path / "hf"
    for name, value in {"HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HF_TOKEN_PATH": home / "token",
                        "HF_STORED_TOKENS_PATH": home / "stored_tokens"}.items():  # fmt: skip
        monkeypatch.setattr(constants, name, str(value))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)  # what http_get writes at a time (10 MiB)
    stand_in = StandIn(_checkpoint(tmp_path / "original"))
    monkeypatch.setenv("HF_ENDPOINT", stand_in.endpoint)
    _online(monkeypatch, True)
    try:
        yield stand_in
    finally:
        _downloads_ended()
        stand_in.close()


def _online(monkeypatch: pytest.MonkeyPatch, online: bool) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if online else "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", not online)


def _downloads_ended() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("streamload-hub"):
            thread.join(30)


def _original(tmp_path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "original").glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[n].dtype == want[n].dtype and torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want
    )


def test_a_cached_hub_id_loads_with_no_request(hub: StandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in hub.files:  # the cache as huggingface_hub itself fills it
        huggingface_hub.hf_hub_download(REPO, name, endpoint=hub.endpoint)
    hub.requests.clear()
    want = _original(tmp_path)
    assert _same(streamload.load(REPO, device="cpu"), want)
    assert _same(streamload.load(f"{REPO}@main", device="cpu", verify=True), want)  # the blob names checked
    assert hub.requests == []
    _online(monkeypatch, False)
    assert _same(streamload.load(REPO, device="cpu"), want)
    assert _same(streamload.load(f"hf://{REPO}@{COMMIT}", device="cpu"), want)
    assert hub.requests == []


def test_a_hub_id_not_cached_downloads_into_the_hub_cache_as_it_loads(
    hub: StandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _original(tmp_path)
    assert _same(streamload.load(REPO, device="cpu", verify=True), want)
    resolved = [r for r in hub.requests if r[0] == "hub"]
    assert resolved and all(auth == f"Bearer {TOKEN}" for _, _, _, auth in resolved)  # the token of get_token()
    assert all(auth is None for server, _, _, auth in hub.requests if server == "cdn")  # none leaves the hub
    assert hub.sent == sum(len(b) for n, b in hub.files.items() if n in hub.lfs)  # each byte once
    _downloads_ended()
    cache = tmp_path / "hf" / "hub"
    for name in set(hub.files) - {"config.json"}:  # huggingface_hub finds them, offline, where it keeps them
        found = huggingface_hub.hf_hub_download(REPO, name, cache_dir=cache, local_files_only=True)
        assert Path(found).read_bytes() == hub.files[name]
        assert Path(found).parent.name == COMMIT
    for name, sha in hub.lfs.items():  # linked to blobs named by their SHA-256
        assert (cache / "models--org--tiny" / "snapshots" / COMMIT / name).resolve().name == sha
    report = huggingface_hub.scan_cache_dir(cache)
    assert [r.repo_id for r in report.repos] == [REPO] and not report.warnings
    (repo,) = report.repos
    assert {f.file_name for r in repo.revisions for f in r.files} == set(hub.files) - {"config.json"}
    assert {r.commit_hash for r in repo.revisions} == {COMMIT} and repo.refs["main"].commit_hash == COMMIT
    hub.requests.clear()
    _online(monkeypatch, False)
    assert _same(streamload.load(REPO, device="cpu"), want) and hub.requests == []


def test_tensors_are_handed_out_while_their_file_downloads(hub: StandIn, tmp_path: Path) -> None:
    first = "model-00001-of-00002.safetensors"
    rest = threading.Event()
    hub.held[hub.lfs[first]] = (len(hub.files[first]) // 2, rest)
    want = _original(tmp_path)
    blob = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs" / hub.lfs[first]
    with streamload.iter(REPO, device="cpu") as stream:
        name, tensor = next(iter(stream))
        assert name == "model.layers.10.weight" and torch.equal(tensor, want[name])  # the file's first tensor
        assert not blob.exists() and blob.with_name(f"{blob.name}.incomplete").exists()  # still downloading
        rest.set()
        got = dict([(name, tensor), *stream])
    assert _same(got, want) and blob.is_file()


def test_an_interrupted_download_resumes(hub: StandIn, tmp_path: Path) -> None:
    first = "model-00001-of-00002.safetensors"
    size = len(hub.files[first])
    hub.cut[hub.lfs[first]] = size // 2
    with pytest.raises(StreamloadError, match=rf"{REPO}: {first}: the download failed at \d+ of {size} bytes") as e:
        streamload.load(REPO, device="cpu")
    assert "\n" not in str(e.value) and "the next load resumes" in str(e.value)
    _downloads_ended()
    partial = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs" / f"{hub.lfs[first]}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept <= size // 2 and f"failed at {kept} of" in str(e.value)
    hub.failing.clear()
    hub.sent = 0
    assert _same(streamload.load(REPO, device="cpu"), _original(tmp_path))
    assert hub.sent == size - kept  # only what the first load lacked
    assert any(r == f"bytes={kept}-" for server, _, r, _ in hub.requests if server == "cdn")
    assert not partial.exists()


def test_a_damaged_partial_file_is_caught_by_its_sha256(hub: StandIn, tmp_path: Path) -> None:
    first = "model-00001-of-00002.safetensors"
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{hub.lfs[first]}.incomplete").write_bytes(b"\0" * 1000)  # not the file's first bytes
    # its zeros read as they are (a header that is none), or, where its verdict came first, refused by its SHA-256
    with pytest.raises(StreamloadError, match=rf"{first}: (not a safetensors file|its SHA-256 is [0-9a-f]{{64}})"):
        streamload.load(REPO, device="cpu")
    _downloads_ended()  # the download went on, and its hash at the end refused the file
    assert not (blobs / hub.lfs[first]).exists() and not (blobs / f"{hub.lfs[first]}.incomplete").exists()
    assert _same(streamload.load(REPO, device="cpu"), _original(tmp_path))  # downloaded anew


def test_from_pretrained_of_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub: StandIn) -> None:
    transformers = pytest.importorskip("transformers")
    from .test_transformers import MODELS

    folder = tmp_path / "llama"
    MODELS["llama"]().save_pretrained(folder, max_shard_size="100KB")  # several shards and an index
    hub.files = {p.name: p.read_bytes() for p in folder.iterdir()}  # the stand-in serves this repo now
    hub.lfs = {n: hashlib.sha256(b).hexdigest() for n, b in hub.files.items() if n.endswith(".safetensors")}
    hub.blobs = {sha: hub.files[n] for n, sha in hub.lfs.items()}
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    tokens = torch.tensor([[1, 5, 9, 3]])
    ours = streamload.from_pretrained(REPO, device="cpu")
    assert torch.equal(ours(tokens).logits, reference(tokens).logits)
    _online(monkeypatch, False)
    hub.requests.clear()
    again = streamload.from_pretrained(REPO, device="cpu")  # from the cache alone
    assert torch.equal(again(tokens).logits, reference(tokens).logits) and hub.requests == []


def test_offline_with_nothing_cached_names_the_repo(hub: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    _online(monkeypatch, False)
    with pytest.raises(MissingFileError, match=rf"^{REPO}: not in the Hugging Face cache .*HF_HUB_OFFLINE") as e:
        streamload.load(REPO, device="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(MissingFileError, match=rf"^{REPO}: not in the Hugging Face cache"):
        streamload.from_pretrained(REPO, device="cpu")
    assert hub.requests == []


def test_an_unknown_repo_or_revision_is_named(hub: StandIn) -> None:
    with pytest.raises(MissingFileError, match=r"^org/absent: no such local path, and no such repo on http://127"):
        streamload.load("org/absent", device="cpu")
    with pytest.raises(MissingFileError, match=rf"^{REPO}: no revision 'v9'"):
        streamload.load(f"{REPO}@v9", device="cpu")


def test_a_missing_local_path_is_still_no_such_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for missing in (str(tmp_path / "absent"), "./absent", "a/b/c", "absent.safetensors", "dir/model.safetensors"):
        with pytest.raises(MissingFileError, match="no such file or directory"):
            streamload.load(missing, device="cpu")
    with pytest.raises(SourceError, match=r"absent: no such directory"):
        streamload.from_pretrained(str(tmp_path / "absent"), device="cpu")
    (tmp_path / "org").mkdir()
    save_file({"x": torch.ones(2)}, tmp_path / "org" / "tiny")  # a local path named like a repo wins
    assert streamload.load("org/tiny", device="cpu")["x"].tolist() == [1.0, 1.0]
