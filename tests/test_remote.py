"""Object storage on real servers: moto's S3 server and an HTTP server with Range support, both local;
faults (503, resets, stalls), objects replaced mid-load, cancellation, bit-exact results."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
import streamload.pipeline.verify

from .conftest import same_bits
from .servers import RangeServer, s3_server, upload

pytest.importorskip("obstore")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real sharded checkpoint: 4 layers of a small llama-shaped model, `save_torch_state_dict`."""
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(512, 256, generator=g)}
    for i in range(4):
        for name, shape in {"q_proj": (256, 256), "k_proj": (128, 256), "mlp.up_proj": (512, 256)}.items():
            state[f"model.layers.{i}.{name}.weight"] = torch.randn(shape, generator=g).to(torch.bfloat16)
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(256)
    state["lm_head.weight"] = torch.randn(512, 256, generator=g)
    out = tmp_path_factory.mktemp("remote") / "model"
    out.mkdir()
    save_torch_state_dict(state, out, max_shard_size="1MB")
    assert len(list(out.glob("*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()
    return out


def reference(directory: Path) -> dict[str, torch.Tensor]:
    ref: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        ref.update(load_file(f))
    return ref


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert same_bits(got[name], t), name


def replace_every_shard(directory: Path) -> None:
    """Same sizes, other bytes, a later mtime: another ETag, and another Last-Modified (1 s resolution)."""
    for f in directory.glob("*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        os.utime(f, (f.stat().st_atime, f.stat().st_mtime + 5))


@pytest.fixture
def http(checkpoint: Path):
    server = RangeServer(checkpoint.parent)
    yield server
    server.close()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOAD_RETRIES", "3")
    monkeypatch.setenv("STREAMLOAD_TIMEOUT", "1")


# -- S3 ---------------------------------------------------------------------------------------------------
def test_s3_prefix_index_and_single_object(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = reference(checkpoint)
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        local_order = [n for n, _ in streamload.iter(checkpoint, device="cpu")]
        with streamload.iter("s3://models/llama/", device="cpu", chunk_bytes=64 << 10) as stream:
            got = dict(stream)
            assert stream.stats.reader == "range"
        assert_same(got, ref)
        assert [n for n, _ in streamload.iter("s3://models/llama", device="cpu")] == local_order  # layer order kept
        index = "s3://models/llama/model.safetensors.index.json"
        assert_same(streamload.load(index, device="cpu"), ref)
        shard = sorted(checkpoint.glob("*.safetensors"))[0]
        assert_same(streamload.load(f"s3://models/llama/{shard.name}", device="cpu"), load_file(shard))
        assert_same(streamload.load([f"s3://models/llama/{f.name}" for f in sorted(checkpoint.glob("*.safetensors"))],
                                    device="cpu"), ref)  # fmt: skip


def test_s3_errors_name_the_object(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        with pytest.raises(streamload.MissingFileError, match=r"s3://models/llama/nope\.safetensors: no such object"):
            streamload.load("s3://models/llama/nope.safetensors", device="cpu")
        with pytest.raises(streamload.SourceError, match=r"s3://models/empty/: holds no \*\.safetensors"):
            streamload.load("s3://models/empty/", device="cpu")
        with pytest.raises(streamload.UnsupportedError, match="mmap reader reads local storage"):
            streamload.load("s3://models/llama/", device="cpu", reader="mmap")
        for missing in ("s3://nobucket/llama/", "s3://nobucket/llama/model.safetensors"):
            with pytest.raises(streamload.MissingFileError, match=r"no such bucket 'nobucket' \(asked") as e:
                streamload.load(missing, device="cpu")
            assert "\n" not in str(e.value) and "<?xml" not in str(e.value)


def test_s3_object_replaced_after_its_header_was_read(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        stream = streamload.iter(f"s3://models/llama/{shard.name}", device="cpu")  # headers are read here
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF  # same size, other bytes: only the ETag tells
        s3.put_object(Bucket="models", Key=f"llama/{shard.name}", Body=bytes(data))
        with pytest.raises(streamload.ReadError, match=rf"s3://models/llama/{shard.name}: object changed"):
            with stream:
                dict(stream)


def test_s3_into_each_staged_device_the_same(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converting and selecting work on objects as on files, and only selected bytes are fetched."""
    ref = reference(checkpoint)
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        got = streamload.load("s3://models/llama/", device="cpu", dtype=torch.float16, include="*.layers.1.*")
    want = {n: t.to(torch.float16) for n, t in ref.items() if ".layers.1." in n}
    assert_same(got, want)


# -- HTTP -------------------------------------------------------------------------------------------------
def test_http_file_index_and_directory(checkpoint: Path, http: RangeServer) -> None:
    ref = reference(checkpoint)
    assert_same(streamload.load(f"{http.url}/model/", device="cpu"), ref)
    assert_same(streamload.load(f"{http.url}/model/model.safetensors.index.json", device="cpu"), ref)
    shard = sorted(checkpoint.glob("*.safetensors"))[1]
    assert_same(streamload.load(f"{http.url}/model/{shard.name}", device="cpu"), load_file(shard))
    ranges = [r for method, _, r in http.requests if method == "GET" and r]
    assert ranges and all(r.startswith("bytes=") for r in ranges)  # ranged GETs, never a whole object


def test_http_without_range_support_is_a_clear_error(checkpoint: Path) -> None:
    server = RangeServer(checkpoint.parent, ranges=False)
    try:
        shard = sorted(checkpoint.glob("*.safetensors"))[0]
        with pytest.raises(streamload.UnsupportedError, match=r"does not honour HTTP Range"):
            streamload.load(f"{server.url}/model/{shard.name}", device="cpu")
    finally:
        server.close()


def test_http_directory_without_index_or_model_file(tmp_path: Path) -> None:
    server = RangeServer(tmp_path)
    try:
        with pytest.raises(streamload.SourceError, match="cannot be listed"):
            streamload.load(f"{server.url}/", device="cpu")
    finally:
        server.close()


@pytest.mark.parametrize("fault", ["503", "reset", "stall:3"])
def test_transient_faults_are_retried(checkpoint: Path, http: RangeServer, fast_retries: None, fault: str) -> None:
    ref = reference(checkpoint)
    http.faults = [fault, fault]
    got = streamload.load(f"{http.url}/model/", device="cpu", chunk_bytes=256 << 10)
    assert_same(got, ref)
    assert not http.faults  # both were met, and retried past


def test_a_store_that_closes_connections_past_its_cap_is_backed_off_from_not_failed(tmp_path: Path) -> None:
    """A store that accepts a few connections at once and closes the rest unanswered (nginx with its
    `worker_connections` used up), 1 MB/s a response: the load goes down to fewer requests at once, as
    object-store clients back off, and is exact, instead of failing after its attempts."""
    torch.manual_seed(1)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1024, 1024, dtype=torch.bfloat16) for i in range(12)}
    save_file(tensors, str(tmp_path / "model.safetensors"))  # 24 MB
    server = RangeServer(tmp_path, rate=1e6, connections=6)
    try:
        assert_same(streamload.load(f"{server.url}/model.safetensors", device="cpu"), tensors)
        assert server.refused > 0  # it did meet closed connections (16 requests at first)
    finally:
        server.close()


def test_persistent_failure_names_url_and_range(checkpoint: Path, http: RangeServer, fast_retries: None) -> None:
    http.faults = ["503"] * 100
    with pytest.raises(streamload.ReadError, match=r"http://127\.0\.0\.1:\d+/model/.*: reading bytes \d+-\d+ failed "
                       r"after 4 attempts"):  # fmt: skip
        streamload.load(f"{http.url}/model/", device="cpu", chunk_bytes=256 << 10)


@pytest.mark.parametrize("etags", [True, False], ids=["etag", "last-modified"])
def test_http_object_replaced_mid_load(
    checkpoint: Path, tmp_path: Path, etags: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught by the ETag (If-Match, and each response's), or by Last-Modified where a server sends none
    (and the caller took such a server: without a strong ETag a load is refused unless allowed)."""
    import shutil

    if not etags:
        monkeypatch.setenv("STREAMLOAD_ALLOW_UNVALIDATED", "1")

    copy = tmp_path / "model"
    shutil.copytree(checkpoint, copy)
    server = RangeServer(tmp_path, etags=etags)
    try:
        assert_same(streamload.load(f"{server.url}/model/", device="cpu"), reference(checkpoint))
        stream = streamload.iter(f"{server.url}/model/", device="cpu")
        replace_every_shard(copy)
        with pytest.raises(streamload.ReadError, match="object changed after its header was read"):
            with stream:
                dict(stream)
    finally:
        server.close()


def test_closing_drops_stalled_requests_within_a_second(checkpoint: Path, http: RangeServer) -> None:
    http.faults = ["stall:30"] * 64  # every data request hangs
    stream = streamload.iter(f"{http.url}/model/", device="cpu", chunk_bytes=256 << 10)
    it = stream.__iter__()
    import threading

    failed: list[BaseException] = []

    def consume() -> None:
        try:
            next(it)
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 5
    while http.data_requests() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.data_requests() > 0
    start = time.perf_counter()
    stream.close()
    t.join(5)
    assert time.perf_counter() - start < 1.0
    assert not t.is_alive() and failed


@pytest.mark.anyio
async def test_async_cancel_drops_stalled_requests_within_a_second(checkpoint: Path, http: RangeServer) -> None:
    import anyio

    http.faults = ["stall:30"] * 64
    start = time.perf_counter()
    with anyio.move_on_after(0.5) as scope:
        async with streamload.iter(f"{http.url}/model/", device="cpu", chunk_bytes=256 << 10) as stream:
            async for _ in stream:
                pass
    assert scope.cancelled_caught
    # the cancel fired at 0.5 s; leaving the block (closing the stream) must not wait for the stalls
    assert time.perf_counter() - start < 1.5


# -- the local cache --------------------------------------------------------------------------------------
def test_cache_dir_keeps_a_copy_and_the_next_load_reads_it(checkpoint: Path, http: RangeServer, tmp_path: Path) -> None:
    ref = reference(checkpoint)
    cache = tmp_path / "cache"
    assert_same(streamload.load(f"{http.url}/model/", device="cpu", cache_dir=cache), ref)
    copies = sorted(p for p in cache.rglob("*.safetensors"))
    assert [p.name for p in copies] == sorted(f.name for f in checkpoint.glob("*.safetensors"))
    for p in copies:
        assert p.read_bytes() == (checkpoint / p.name).read_bytes()
    assert not list(cache.rglob("*.partial"))

    before = http.data_requests()
    with streamload.iter(f"{http.url}/model/", device="cpu", cache_dir=cache) as stream:
        got = dict(stream)
        assert stream.stats.reader == "mmap"  # local now
    assert_same(got, ref)
    assert http.data_requests() == before  # only the headers were asked for, to check the versions


def test_cache_is_not_used_once_the_object_changed(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    served = tmp_path / "www"
    shutil.copytree(checkpoint, served / "model")
    server = RangeServer(served)
    cache = tmp_path / "cache"
    try:
        streamload.load(f"{server.url}/model/", device="cpu", cache_dir=cache)
        shard = sorted((served / "model").glob("*.safetensors"))[0]
        changed = load_file(shard)
        changed = {n: t + 1 if t.is_floating_point() else t for n, t in changed.items()}
        from safetensors.torch import save_file

        save_file(changed, shard, metadata={"format": "pt"})
        with streamload.iter(f"{server.url}/model/", device="cpu", cache_dir=cache) as stream:
            got = dict(stream)
            assert stream.stats.reader == "range"
        assert_same(got, reference(served / "model"))
        copy = next(p for p in cache.rglob(shard.name))
        assert copy.read_bytes() == shard.read_bytes()  # the new version replaced the old copy
    finally:
        server.close()


def test_partial_load_leaves_no_copy(checkpoint: Path, http: RangeServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    streamload.load(f"{http.url}/model/", device="cpu", cache_dir=cache, include="*.layers.0.*")
    complete = [p for p in cache.rglob("*.safetensors")]
    for p in complete:  # a file whose every byte was read (all its tensors selected) may be complete
        assert p.read_bytes() == (checkpoint / p.name).read_bytes()
    assert not list(cache.rglob("*.partial"))
    assert len(complete) < len(list(checkpoint.glob("*.safetensors")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_s3_into_cuda(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = reference(checkpoint)
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        with streamload.iter("s3://models/llama/", device="cuda:0") as stream:
            got = {n: t.cpu() for n, t in stream}
            assert stream.stats.reader == "range"
    assert_same(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_http_into_cuda(checkpoint: Path, http: RangeServer) -> None:
    with streamload.iter(f"{http.url}/{checkpoint.name}/", device="cuda:0") as stream:
        got = {n: t.cpu() for n, t in stream}
        assert stream.stats.reader == "range" and str(stream.stats.device) == "cuda:0"
    assert_same(got, reference(checkpoint))


def test_s3_credentials_from_a_named_profile(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        credentials = tmp_path / "credentials"
        credentials.write_text("[bench]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        monkeypatch.setenv("AWS_PROFILE", "bench")
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        assert_same(streamload.load("s3://models/llama/", device="cpu"), reference(checkpoint))


# -- verify=, from_pretrained, and what a new user meets ------------------------------------------------------
def test_s3_etag_md5_verifies_whole_objects(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    shards = sorted(checkpoint.glob("*.safetensors"))
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        ckpt = streamload.inspect("s3://models/llama/")
        known = streamload.pipeline.verify.known_digests(ckpt)
        assert [k.whole.hex for k in known.values()] == [hashlib.md5(f.read_bytes()).hexdigest() for f in shards]
        with streamload.iter("s3://models/llama/", device="cpu", verify=True) as stream:
            got = dict(stream)
        assert_same(got, reference(checkpoint))
        assert stream.stats.bytes_verified == sum(f.stat().st_size for f in shards)
        wrong = {shards[1].name: "0" * 32}  # an MD5 the object does not have
        with pytest.raises(streamload.IntegrityError, match=rf"{shards[1].name}: the file's MD5 is [0-9a-f]{{32}}"):
            streamload.load("s3://models/llama/", device="cpu", verify=wrong)


def test_http_digest_file_next_to_the_objects(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    from streamload.pipeline.verify import write_digests

    served = tmp_path / "www"
    shutil.copytree(checkpoint, served / "model")
    write_digests(streamload.inspect(served / "model"))
    server = RangeServer(served)
    try:
        with streamload.iter(f"{server.url}/model/", device="cpu", verify=True) as stream:
            got = dict(stream)
        assert_same(got, reference(checkpoint))
        assert stream.stats.bytes_verified == stream.stats.bytes_read
        cache = tmp_path / "cache"
        streamload.load(f"{server.url}/model/", device="cpu", verify=True, cache_dir=cache)  # kept, digests too
        with streamload.iter(f"{server.url}/model/", device="cpu", verify=True, cache_dir=cache) as stream:
            assert stream.stats.reader == "mmap"  # the local copy, still checked against the digest file
            dict(stream)
        assert stream.stats.bytes_verified == stream.stats.bytes_read > 0
        info = streamload.inspect(served / "model").tensors["model.layers.1.q_proj.weight"]
        with open(info.path, "r+b") as f:  # damaged on the server, same size (its ETag changes with its mtime)
            f.seek(info.begin + 100)
            f.write(b"\x00\x01")
        with pytest.raises(streamload.IntegrityError, match="'model.layers.1.q_proj.weight': bytes 0..131072"):
            streamload.load(f"{server.url}/model/", device="cpu", verify=True)
    finally:
        server.close()


def test_from_pretrained_from_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)  # fmt: skip
    local = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(local, max_shard_size="100KB")
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    want = streamload.from_pretrained(local, device="cpu")(ids).logits
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", local)
        model = streamload.from_pretrained("s3://models/llama/", device="cpu", dtype="float32")
        assert torch.equal(model(ids).logits, want)
        with pytest.raises(streamload.UnsupportedError, match="s3://models/nothing/config.json: no such object"):
            streamload.from_pretrained("s3://models/nothing/", device="cpu")


def test_cache_dir_says_a_partial_load_is_not_cached(
    checkpoint: Path, http: RangeServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="streamload"):
        streamload.load(f"{http.url}/model/", device="cpu", cache_dir=tmp_path / "c", exclude="*norm*")
    assert "cache_dir keeps whole files only" in caplog.text and "of its tensors are left out" in caplog.text


def test_s3_without_credentials_names_them() -> None:
    from streamload.storage.remote import ObjectPath, _named, _transient

    # What an S3 client reports off EC2 with no keys: the instance metadata service's answer.
    exc = RuntimeError(
        "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in 6ms - "
        "Server returned non-2xx status code: 403 Forbidden: resolve_deny: denied destination"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AWS_ACCESS_KEY_ID", raising=False)
        message = str(_named(exc, ObjectPath("s3://b/m/model.safetensors"), None))
        assert not _transient(exc)
    assert message.startswith("s3://b/m/model.safetensors: no AWS credentials: set AWS_ACCESS_KEY_ID and")
    assert "AWS_PROFILE" in message and "instance metadata service" in message


def test_a_refused_digest_file_counts_as_absent(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # S3 answers 403, not 404, for a missing key to a caller without ListBucket: the ETag still serves.
    from streamload.storage.remote import ObjectStorage

    real = ObjectStorage.call

    def refuse_digests(self: ObjectStorage, request: object, path: object, *args: object, **kw: object) -> object:
        if str(path).endswith("streamload.digests.json"):
            raise streamload.ReadError(f"{path}: access denied: check the credentials (403 Forbidden)")
        return real(self, request, path, *args, **kw)  # type: ignore[arg-type]

    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "llama/", checkpoint)
        monkeypatch.setattr(ObjectStorage, "call", refuse_digests)
        with caplog.at_level("WARNING", logger="streamload"):
            with streamload.iter("s3://models/llama/", device="cpu", verify=True) as stream:
                dict(stream)
        assert stream.stats.bytes_verified > 0 and "streamload.digests.json: taken as absent" in caplog.text
