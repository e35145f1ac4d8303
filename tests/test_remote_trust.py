"""What a remote load trusts: objects replaced mid-load on servers with and without validators (never a
torn or mixed tensor handed out), credentials in a URL (never in a log, an error or a file name), and a
server that answers other bytes than asked for; all against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.format.header import FileHeader, FileVersion
from streamload.integrity.digests import Version, bound, version_of
from streamload.storage.remote import ObjectPath

from .servers import RangeServer

pytest.importorskip("obstore")

ALLOW = "STREAMLOAD_ALLOW_UNVALIDATED"
Tensors = dict[str, torch.Tensor]


# -- an object replaced mid-load ----------------------------------------------------------------------------
class Versions:
    """One object served at `www/model.safetensors` (v1), and v2: the same names, shapes and size (so the
    same header bytes), every tensor's values other. `swap_after(n, mtime)` has the server replace v1 by
    v2 (a rename, as a deploy does) just before its n-th request, with the given modification time."""

    def __init__(self, root: Path) -> None:
        g = torch.Generator().manual_seed(3)
        # 24 tensors of 256 KiB, at offsets no request boundary (256 KiB apart) falls between: each is
        # read by two requests, so a swap between them would tear it.
        self.v1: Tensors = {
            f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 1024, generator=g) for i in range(24)
        }
        self.v2: Tensors = {n: t + 1 for n, t in self.v1.items()}
        self.www = root / "www"
        self.www.mkdir()
        self.served = self.www / "model.safetensors"
        self.staged = root / "v2.safetensors"
        save_file(self.v1, str(self.served))
        save_file(self.v2, str(self.staged))
        assert self.served.stat().st_size == self.staged.stat().st_size
        self.mtime_ns = self.served.stat().st_mtime_ns
        self.swapped = False

    def swap_after(self, n: int, mtime_ns: int) -> Callable[[int], None]:
        def on_request(number: int) -> None:
            if number == n + 1 and not self.swapped:
                os.replace(self.staged, self.served)
                os.utime(self.served, ns=(mtime_ns, mtime_ns))
                self.swapped = True

        return on_request

    def versions_of(self, got: Tensors) -> set[str]:
        """Which version each tensor handed out is: "v1", "v2", or "torn" (bytes of both, or of neither)."""
        return {
            "v1" if torch.equal(t, self.v1[n]) else "v2" if torch.equal(t, self.v2[n]) else "torn"
            for n, t in got.items()
        }


def consume(url: str, **options: object) -> tuple[Tensors, BaseException | None]:
    """Every tensor the load hands out (copied), until it ends or fails; and how it failed."""
    got: Tensors = {}
    try:
        with streamload.iter(url, device="cpu", chunk_bytes=256 << 10, **options) as stream:  # type: ignore[arg-type]
            for name, t in stream:
                got[name] = t.clone()
    except streamload.StreamloadError as exc:
        return got, exc
    return got, None


@pytest.fixture
def versions(tmp_path: Path) -> Versions:
    return Versions(tmp_path)


@contextmanager
def served(versions: Versions, on_request: Callable[[int], None], **kw: bool) -> Iterator[RangeServer]:
    server = RangeServer(versions.www, on_request=on_request, **kw)
    try:
        yield server
    finally:
        server.close()


LATER, FORGED = 5_000_000_000, 0  # the replacement's mtime: 5 s later (another ETag and Last-Modified), or the same


@pytest.mark.parametrize(
    "case",
    ["etag", "last-modified", "last-modified-forged", "neither", "weak-etag"],
)
def test_an_object_replaced_mid_load_never_hands_out_a_torn_or_mixed_tensor(
    versions: Versions, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Same size, swapped after 3 requests (the header's and two ranges): with a strong ETag the load
    fails on the first range of v2; without one nothing the server says tells the swap for sure (a forged
    Last-Modified answers as before), so the object is refused before a byte of its tensors is read."""
    kw = {
        "etag": {},
        "last-modified": {"etags": False},
        "last-modified-forged": {"etags": False},
        "neither": {"etags": False, "last_modified": False},
        "weak-etag": {"weak": True},
    }[case]
    mtime = versions.mtime_ns + (FORGED if case == "last-modified-forged" else LATER)
    with served(versions, versions.swap_after(3, mtime), **kw) as server:
        url = f"{server.url}/model.safetensors"
        with caplog.at_level(logging.WARNING, logger="streamload"):
            got, error = consume(url)
        assert versions.versions_of(got) <= {"v1"}, f"handed out {sorted(versions.versions_of(got))}"
        if case == "etag":
            assert isinstance(error, streamload.ReadError) and "object changed after its header was read" in str(error)
            assert "no strong ETag" not in caplog.text
            return
        assert isinstance(error, streamload.UnsupportedError), error
        assert not got and server.data_requests() == 0  # refused before reading
        message = str(error)
        assert message.startswith(f"{url}: the server sends no strong ETag") and f"{ALLOW}=1" in message
        assert "verify=True" in message


def test_allowed_a_changed_last_modified_is_caught_on_the_range_that_brings_it(
    versions: Versions, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Opted in: one warning naming the URL, and every range asked `If-Unmodified-Since` and checked
    against the Last-Modified and size read with the header."""
    monkeypatch.setenv(ALLOW, "1")
    with served(versions, versions.swap_after(3, versions.mtime_ns + LATER), etags=False) as server:
        url = f"{server.url}/model.safetensors"
        with caplog.at_level(logging.WARNING, logger="streamload"):
            got, error = consume(url)
        assert versions.versions_of(got) <= {"v1"}
        assert isinstance(error, streamload.ReadError) and "object changed after its header was read" in str(error)
        warned = [r.getMessage() for r in caplog.records if "no strong ETag" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith(f"streamload: {url}: ")


def test_allowed_a_forged_last_modified_is_caught_by_per_tensor_digests(
    versions: Versions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the server says cannot tell this swap; the digest file's blocks, checked before each tensor
    is handed out, do: the load fails on v2's first tensor, having handed out v1's only."""
    from streamload.pipeline.verify import write_digests

    write_digests(streamload.inspect(versions.served))
    monkeypatch.setenv(ALLOW, "1")
    with served(versions, versions.swap_after(4, versions.mtime_ns), etags=False) as server:  # + the digest file
        got, error = consume(f"{server.url}/model.safetensors", verify=True)
        assert versions.versions_of(got) <= {"v1"}
        assert isinstance(error, streamload.IntegrityError), error


def test_allowed_a_weak_etag_is_not_sent_as_if_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`If-Match` compares strongly (RFC 9110): a weak ETag never matches, so sending it failed every load."""
    monkeypatch.setenv(ALLOW, "1")
    versions = Versions(tmp_path)
    server = RangeServer(versions.www, weak=True)
    try:
        got, error = consume(f"{server.url}/model.safetensors")
    finally:
        server.close()
    assert error is None and versions.versions_of(got) == {"v1"} and len(got) == len(versions.v1)


# -- credentials in a URL -----------------------------------------------------------------------------------
SECRET = "s3cr3t-pa55"


def texts_of(exc: BaseException) -> list[str]:
    """str and repr of an exception and of every exception it was raised from or during."""
    out, seen = [], set()
    e: BaseException | None = exc
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        out += [str(e), repr(e)]
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    return out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[RangeServer, Path]]:
    www = tmp_path / "www"
    (www / "model").mkdir(parents=True)
    torch.manual_seed(0)
    save_file(
        {f"model.layers.{i}.q_proj.weight": torch.randn(256, 256) for i in range(4)},
        str(www / "model" / "model.safetensors"),
    )
    (www / "model" / "bad.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")  # a header of 1 TiB
    server = RangeServer(www)
    yield server, www
    server.close()


def test_a_urls_password_is_in_no_log_error_or_file_name(
    store: tuple[RangeServer, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = store
    base = server.url.replace("http://", f"http://user:{SECRET}@") + "/model"
    cache = tmp_path / "cache"
    with caplog.at_level(logging.DEBUG):
        got = streamload.load(f"{base}/model.safetensors", device="cpu", cache_dir=cache)
        assert len(got) == 4
        with streamload.iter(f"{base}/", device="cpu", cache_dir=cache) as stream:  # from the copy now
            dict(stream)
        assert SECRET not in str(stream.stats) and SECRET not in repr(stream.stats)
        failures = []
        for source, kind in [(f"{base}/nope.safetensors", streamload.MissingFileError),
                             (f"{base}/bad.safetensors", streamload.HeaderError),
                             (f"{base}/empty/", streamload.SourceError),  # neither an index nor model.safetensors
                             ([f"{base}/model.safetensors", f"http://u:{SECRET}@127.0.0.2:9/x.safetensors"],
                              streamload.SourceError)]:  # fmt: skip
            with pytest.raises(kind) as e:
                streamload.load(source, device="cpu", cache_dir=cache)
            failures.append(e.value)
    assert all(SECRET not in text for exc in failures for text in texts_of(exc)), [str(e) for e in failures]
    assert "http://***@127.0.0.2:9/x.safetensors" in str(failures[-1])  # a source as written is shown redacted
    assert f"{server.url}/model/nope.safetensors: no such object" in str(failures[0])
    assert caplog.records and not [r.getMessage() for r in caplog.records if SECRET in r.getMessage()]
    names = [str(p.relative_to(cache)) for p in cache.rglob("*")]
    assert names and not [n for n in names if SECRET in n or "user" in n]
    expected = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
    assert server.authorizations and set(server.authorizations) == {expected}  # the credentials were used


def test_the_command_line_shows_no_password(
    store: tuple[RangeServer, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.commands.cli import main

    server, _ = store
    base = server.url.replace("http://", f"http://user:{SECRET}@") + "/model"
    assert main(["load", f"{base}/model.safetensors", "--device", "cpu"]) == 0
    assert main(["load", f"{base}/nope.safetensors", "--device", "cpu"]) == 1
    assert main(["inspect", f"{base}/model.safetensors"]) == 0
    out = capsys.readouterr()
    assert "no such object" in out.err and "4 tensors" in out.out
    assert SECRET not in out.out + out.err


# -- a server that misbehaves, a stream closed while read ---------------------------------------------------
def test_a_206_with_another_content_range_is_refused_at_once_naming_the_server(
    versions: Versions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMLOAD_RETRIES", "3")
    server = RangeServer(versions.www)
    try:
        server.faults = ["range"]
        got, error = consume(f"{server.url}/model.safetensors")
        assert isinstance(error, streamload.ReadError), error
        assert "the server misbehaves" in str(error) and "Content-Range" in str(error)
        assert f"{server.url}/model.safetensors" in str(error) and "attempts" not in str(error)
        assert versions.versions_of(got) <= {"v1"}
    finally:
        server.close()


def test_closing_a_remote_stream_from_another_thread_says_it_was_closed_while_read(versions: Versions) -> None:
    arrived, gate = threading.Event(), threading.Event()

    def hold(number: int) -> None:  # every request after the header's waits until the test ends
        if number > 1:
            arrived.set()
            gate.wait(10)

    server = RangeServer(versions.www, on_request=hold)
    failed: list[BaseException] = []
    try:
        stream = streamload.iter(f"{server.url}/model.safetensors", device="cpu", chunk_bytes=256 << 10)

        def consume_all() -> None:
            try:
                for _ in stream:
                    pass
            except BaseException as exc:
                failed.append(exc)

        t = threading.Thread(target=consume_all)
        t.start()
        assert arrived.wait(5)  # the consumer waits for the first batch's bytes
        stream.close()
        t.join(5)
    finally:
        gate.set()
        server.close()
    assert not t.is_alive() and len(failed) == 1, failed
    message = str(failed[0])
    assert "the stream was closed" in message and "being read" in message, message
    assert "the load was stopped" not in message, message


def test_redacted_hides_user_info_in_any_text() -> None:
    from streamload.storage.base import redacted

    assert redacted("https://user:p@ss@h.example/m/x.safetensors") == "https://***@h.example/m/x.safetensors"
    assert redacted("see http://tok@h/a and s3://bucket/k@1") == "see http://***@h/a and s3://bucket/k@1"
    assert redacted(Path("/local/a@b")) == "/local/a@b"


@pytest.mark.parametrize("scheme, names", [("s3", "AWS_ACCESS_KEY_ID"), ("gs", "GOOGLE_APPLICATION_CREDENTIALS"),
                                           ("az", "AZURE_STORAGE_ACCOUNT_KEY")])  # fmt: skip
def test_credentials_in_a_cloud_url_are_refused_without_showing_them(scheme: str, names: str) -> None:
    with pytest.raises(streamload.SourceError, match=rf"{scheme}://\*\*\*@bucket: credentials in the URL are not "
                       rf"used: .* from the environment: set .*{names}") as e:  # fmt: skip
        streamload.load(f"{scheme}://key:{SECRET}@bucket/model/", device="cpu")
    assert SECRET not in str(e.value)


def test_a_password_before_an_azure_account_is_still_a_credential_refused_unshown() -> None:
    """`abfs://container@account.dfs.core.windows.net` names places; with a password in it, it names credentials."""
    with pytest.raises(streamload.SourceError, match="credentials in the URL are not used") as e:
        streamload.load(f"abfs://models:{SECRET}@account.dfs.core.windows.net/model/", device="cpu")
    assert SECRET not in str(e.value)


# -- a digest entry bound to an object's version -------------------------------------------------------------
V1_MD5 = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"  # the MD5 of the version an entry was made from
ENTRY = {"size": 1000, "md5": V1_MD5, "origin": {"etag": '"made-from-version-1"'}}


def version_served(url: str, etag: str) -> Version:
    """The version a load of `url` binds digest entries to, its store answering with `etag`."""
    from streamload.storage import storage_for

    header = FileHeader(ObjectPath(url), 1000, 8, (), None, FileVersion(1000, etag=etag))
    return version_of(header, storage_for(url).digest(header))


@pytest.mark.parametrize("url", ["http://h/m.safetensors", "https://h/m.safetensors", "gs://bucket/m.safetensors",
                                 "az://container/m.safetensors"])  # fmt: skip
def test_an_opaque_etag_equal_to_an_entrys_md5_does_not_bind_it(url: str) -> None:
    """These stores' ETags are opaque: one that reads as the entry's MD5 (chosen so, or by chance) says nothing
    of the bytes, so the entry's digests of another version are not taken for this one."""
    assert bound(ENTRY, version_served(url, f'"{V1_MD5}"')) is not None


def test_an_s3_etag_binds_an_entry_by_md5_only_where_it_is_one() -> None:
    assert bound(ENTRY, version_served("s3://bucket/m.safetensors", f'"{V1_MD5}"')) is None  # a single-part PUT's
    assert bound(ENTRY, version_served("s3://bucket/m.safetensors", f'"{V1_MD5}-2"')) is not None  # multipart
    assert bound(ENTRY, version_served("s3://bucket/m.safetensors", '"made-from-version-1"')) is None
