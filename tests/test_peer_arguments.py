"""`peers=`'s entries: each one text (a peer's URL, `host[:port]` or a name), or the load is refused in
one line naming the entry, whatever entry point takes it (storage/peers.py `names`, `resolve`; argument_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.storage.peers import names, resolve


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(("peers", "named"), [([None, 5], "None"), (["", None], "None"),
                                              (["http://127.0.0.1:1", 5], "int 5"), ((b"x",), "bytes")])  # fmt: skip
def test_a_load_refuses_an_entry_that_is_not_text(ckpt: Path, peers: list[object], named: str) -> None:
    with pytest.raises(TypeError, match="peers") as info:
        streamload.load(ckpt, device="cpu", peers=peers)  # type: ignore[arg-type]
    assert named in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("peers", [[None, 5], ["127.0.0.1:1", None], [3.5]])
def test_names_and_resolve_refuse_an_entry_that_is_not_text(peers: list[object]) -> None:
    for call in (names, resolve):
        with pytest.raises(TypeError, match=r"peers\[\d\]"):
            call(peers)  # type: ignore[arg-type]


def test_the_storage_a_prefetch_reads_through_refuses_an_entry_that_is_not_text() -> None:
    from streamload.storage.peers import with_peers

    with pytest.raises(TypeError, match=r"peers\[0\] must be a URL or a host name \(text\), not NoneType None"):
        with_peers(object(), [None, 5])  # type: ignore[list-item]  # prefetch.fetch's objects are read so


def test_text_entries_still_pass(ckpt: Path) -> None:
    assert names(" a:1, ,b:2") == ["a:1", "b:2"] and names(["a:1", " ", "b"]) == ["a:1", "b"] and names(None) == []
    assert streamload.load(ckpt, device="cpu", peers=["127.0.0.1:1"]).keys() == {"w"}  # a local load asks no peer
