"""What a load with peers says: no peer URL's password in any line, and one message for a digest file that
cannot be read. The store is tests/servers.py's RangeServer on 127.0.0.1; no peer answers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.base.errors import IntegrityError
from streamload.integrity.digests import DIGEST_FILE

from .servers import RangeServer

pytest.importorskip("obstore")
pytest.importorskip("xxhash")

SECRET = "s3cr3t-pw"


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A one-file checkpoint over HTTP (its URL, its folder), the digest file not yet written."""
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "1")
    monkeypatch.delenv("STREAMLOAD_PEERS_UNVERIFIED", raising=False)
    folder = tmp_path / "www" / "model"
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, folder / "model.safetensors")
    server = RangeServer(tmp_path / "www")
    try:
        yield f"{server.url}/model/model.safetensors", folder
    finally:
        server.close()


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def test_no_line_names_a_peers_password(
    served: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from streamload.pipeline.verify import write_digests

    url, folder = served
    write_digests(streamload.inspect(url), out=folder / DIGEST_FILE)
    caplog.set_level(logging.DEBUG, logger="streamload")
    peers = [f"http://user:{SECRET}@127.0.0.1:9", f"user:{SECRET}@127.0.0.1:9"]
    got = streamload.load(url, device="cpu", peers=peers, cache_dir=tmp_path / "cache")
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32))
    lines = _lines(caplog)
    assert any("peer" in line for line in lines), lines  # it did say something about them
    assert not [line for line in lines if SECRET in line], lines


def test_a_corrupt_digest_file_is_said_once_as_corrupt(
    served: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, folder = served
    (folder / DIGEST_FILE).write_text("{ not json")
    caplog.set_level(logging.WARNING, logger="streamload")
    got = streamload.load(url, device="cpu", peers="127.0.0.1:9", cache_dir=tmp_path / "cache")
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32))
    about = [line for line in _lines(caplog, logging.WARNING) if DIGEST_FILE in line]
    assert len(about) == 1, about
    assert "invalid JSON" in about[0] and "absent" not in about[0], about


def test_a_corrupt_digest_file_with_verify_is_one_error(
    served: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, folder = served
    (folder / DIGEST_FILE).write_text("{ not json")
    caplog.set_level(logging.WARNING, logger="streamload")
    with pytest.raises(IntegrityError, match="invalid JSON") as raised:
        streamload.load(url, device="cpu", peers="127.0.0.1:9", verify=True, cache_dir=tmp_path / "cache")
    assert "absent" not in str(raised.value)
    said = [line for line in _lines(caplog, logging.WARNING) if DIGEST_FILE in line]
    assert not said, said  # the error says it: no warning besides
