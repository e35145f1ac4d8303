"""The logic of the CUDA paths that runs without a GPU: kvikio's setup and probe falling back, with
kvikio and the reader replaced by stand-ins that fail the way the real ones do."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from streamload import UnsupportedError, routes
from streamload.defaults import Tuning
from streamload.read import kvikio as kvikio_reader


class FakeDefaults:
    def __init__(self) -> None:
        self.values = {"num_threads": 1, "task_size": 4 << 20}
        self.sets: list[dict[str, int]] = []

    def get(self, key: str) -> int:
        return self.values[key]

    def set(self, changes: dict[str, int]) -> None:
        self.sets.append(changes)
        self.values.update(changes)

    def is_compat_mode_preferred(self) -> bool:
        return False  # GDS, as a machine with cuFile reports it


@pytest.fixture
def fake_kvikio(monkeypatch: pytest.MonkeyPatch) -> FakeDefaults:
    defaults = FakeDefaults()
    module = types.ModuleType("kvikio")
    module.defaults = defaults  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)  # type: ignore[arg-type]
    return defaults


def test_settings_are_set_only_when_they_change(fake_kvikio: FakeDefaults) -> None:
    kvikio_reader.KvikioReader(8, 4 << 20)
    kvikio_reader.KvikioReader(8, 4 << 20)
    kvikio_reader.KvikioReader(8, 16 << 20)
    # a new thread count rebuilds kvikio's pool: once, and never for an unchanged value
    assert fake_kvikio.sets == [{"num_threads": 8}, {"task_size": 16 << 20}]


def test_a_kvikio_without_defaults_get_is_unsupported(fake_kvikio: FakeDefaults, monkeypatch: Any) -> None:
    monkeypatch.delattr(FakeDefaults, "get")  # kvikio < 25.04
    with pytest.raises(UnsupportedError, match=r"kvikio cannot be set up \(AttributeError.*kvikio >= 25.04"):
        kvikio_reader.KvikioReader(8, 4 << 20)


class ProbeFails:
    """A kvikio reader on a machine where cuFile reports GDS but cannot read the file (tmpfs)."""

    gds = True
    closed = 0

    def __init__(self, threads: int, task_size: int) -> None:
        pass

    def probe(self, path: Path, device: torch.device) -> None:
        raise UnsupportedError(f"kvikio cannot read {path}: cuFile: file system not supported")

    def close(self) -> None:
        ProbeFails.closed += 1


def _load(chosen: bool) -> routes.Load:
    return routes.Load(
        torch.device("cuda", 0), Tuning(1 << 20, 2, 4, 1 << 20), Path("/dev/shm/m.safetensors"), 1, chosen
    )


def test_auto_falls_back_when_the_kvikio_probe_fails(monkeypatch: Any, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kvikio_reader, "KvikioReader", ProbeFails)
    ProbeFails.closed = 0
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert routes._kvikio(_load(chosen=False)) is None  # the next row (posix) serves the load
    assert ProbeFails.closed == 1
    assert "file system not supported; reading with preadv into pinned memory instead" in caplog.text
    with pytest.raises(UnsupportedError, match="file system not supported"):
        routes._kvikio(_load(chosen=True))  # named by the caller: its error
    assert ProbeFails.closed == 2
