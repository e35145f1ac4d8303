"""vLLM's `--model-loader-extra-config` for `--load-format streamload`, checked where the engine's config is
built (`integrations/vllm/options.py`): what vLLM passes by default is no options, and a wrong key, a wrong
type or a source that is not there is one line before any worker starts."""

from __future__ import annotations

import re
from typing import Any

import pytest

from streamload.integrations.vllm.options import check_options


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            {"bogus": 1},
            "unknown model_loader_extra_config keys for load format 'streamload': bogus; known keys: reader",
        ),
        ({"threads": "many"}, "model_loader_extra_config['threads'] must be an int, not 'many'"),
        ({"source": "/nonexistent/dir"}, "model_loader_extra_config['source']: /nonexistent/dir: no such file or"),
    ],
)
def test_bad_loader_options_are_one_line_before_the_engine_starts(extra: dict[str, Any], said: str) -> None:
    """What vLLM's `create_load_config` (patched in the process that starts the engine, before any
    worker) calls: a wrong key, a wrong type and a source that is not there each one line, no traceback
    from a worker a minute later (the engines' own run asserts the first two through a real engine)."""
    with pytest.raises(ValueError, match=re.escape(said)):
        check_options(extra)
    assert check_options({"source": "s3://bucket/model/"}) == {"source": "s3://bucket/model/"}  # not looked up here


def test_no_loader_options_is_no_options() -> None:
    """vLLM's own default for `model_loader_extra_config`, which its loaders take: no options, not an error."""
    assert check_options(None) == {}
    with pytest.raises(ValueError, match="must be a dict, not list"):
        check_options([])
