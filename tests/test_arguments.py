"""Every public entry point checks its arguments up front: one line naming the argument."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import streamload
from streamload.base import argument_checks as arguments


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("args") / "model.safetensors"
    save_file({"model.norm.weight": torch.arange(4.0), "lm_head.weight": torch.ones(2, 4)}, path)
    return path


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"threads": "4"}, TypeError, "threads must be a whole number, not str '4'"),
        ({"threads": 0}, ValueError, "threads must be at least 1, not 0"),
        ({"threads": 2.5}, TypeError, "threads must be a whole number"),
        ({"threads": True}, TypeError, "threads must be a whole number, not bool"),
        ({"slots": -1}, ValueError, "slots must be at least 1"),
        ({"ring_bytes": "lots"}, ValueError, "ring_bytes: 'lots' is not a size"),
        ({"chunk_bytes": 1.5}, TypeError, "chunk_bytes must be a size in bytes"),
        ({"include": 5}, TypeError, "include must be a pattern"),
        ({"exclude": [1]}, TypeError, "exclude patterns must be text"),
        ({"into": {"model.norm.weight": "x"}}, TypeError, r"into\['model.norm.weight'\] must be a torch.Tensor"),
        ({"into": {"x": torch.ones(1)}}, ValueError, "into= names tensors the checkpoint does not hold: 'x'"),
        ({"shard": "tp"}, TypeError, "shard must be a streamload.ShardSpec"),
        ({"cache_dir": 5}, TypeError, "cache_dir must be a path"),
        ({"verify": "yes"}, TypeError, "verify must be True, False or"),
        ({"verify": 1}, TypeError, "verify must be True, False or"),
        ({"verify": {"model.safetensors": 5}}, TypeError, r"verify\['model.safetensors'\] must be a SHA-256"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_argument(ckpt: Path, options: dict[str, Any], error: type,
                                                        message: str) -> None:  # fmt: skip
    with pytest.raises(error, match=message):
        streamload.load(ckpt, device="cpu", **options)


@pytest.mark.parametrize("source", [5, None, []])
def test_a_source_that_is_no_path_is_named(source: object) -> None:
    with pytest.raises(TypeError, match="source must be a path, a URL"):
        streamload.load(source)  # type: ignore[arg-type]


def test_arguments_of_the_wrong_kind_are_named() -> None:
    """`layer_of(5)` names its argument (not the regular expression's TypeError), and a list source names
    the element that is not a path (not "not list")."""
    with pytest.raises(TypeError, match=r"^layer_of: name must be a tensor name \(text\), not int 5$"):
        streamload.layer_of(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^source\[1\] must be a path or a URL, not int 5$"):
        streamload.load(["model.safetensors", 5])  # type: ignore[list-item]


def test_sizes_take_units_everywhere(ckpt: Path) -> None:
    got = streamload.load(ckpt, device="cpu", ring_bytes="8MiB", chunk_bytes="1MiB", threads=2)
    assert torch.equal(got["model.norm.weight"], torch.arange(4.0))
    assert arguments.size("1.5GiB", "x") == 3 << 29 and arguments.size("4MB", "x") == 4_000_000


def test_a_filter_that_selects_nothing_says_so(ckpt: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert streamload.load(ckpt, device="cpu", include="nothing.*") == {}
    assert any("select none of the checkpoint's 2 tensors" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:  # and names the line that called `iter`
        warnings.simplefilter("always")
        with streamload.iter(ckpt, device="cpu", include="nothing.*") as stream:
            assert list(stream) == []
    assert [w.filename for w in caught if "select none" in str(w.message)] == [__file__]


def test_from_pretrained_of_a_missing_path_says_it_is_missing(tmp_path: Path) -> None:
    with pytest.raises(streamload.SourceError, match="no such directory"):
        streamload.from_pretrained(tmp_path / "nonexistent", device="cpu")


def test_iter_options_are_declared_once() -> None:
    import inspect

    from streamload import api, options

    assert list(options.Options.__annotations__) == list(options.TABLE)
    assert set(inspect.signature(api.iter).parameters) - {"source"} == set(options.TABLE)
    assert options.READ == ("reader", "ring_bytes", "chunk_bytes", "threads", "slots")
    assert options.check("chunk_bytes", "8MiB") == 8 << 20
    with pytest.raises(ValueError, match="threads must be at least 1, not 0"):
        options.check("threads", 0)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("8", TypeError, "reader_threads must be a whole number, not str '8'"),
        (2.0, TypeError, "reader_threads must be a whole number, not float 2.0"),
        (True, TypeError, "reader_threads must be a whole number, not bool"),
        (0, ValueError, "reader_threads must be at least 1, not 0"),
    ],
)
def test_set_limits_refuses_a_thread_count_that_is_not_a_whole_number(value: object, error: type, message: str) -> None:
    from streamload.base import limits

    before = limits.usage().reader_threads
    try:
        with pytest.raises(error, match=message):
            streamload.set_limits(reader_threads=value)  # type: ignore[arg-type]
        assert limits.usage().reader_threads == before and type(limits.usage().reader_threads) is int
    finally:  # a value taken would stay for the rest of the process's tests
        streamload.set_limits(reader_threads=before)
