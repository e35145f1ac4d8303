"""Every `STREAMLOAD_*` variable streamload reads, in one table (`ALL`): its name, type, default and meaning.

Each is read when it is used, never at import, so a value set after `import streamload` (a test's
monkeypatch, a launcher's environment) counts. A value that cannot be read is refused in one line naming the
variable and the value (`SettingError`), never taken as the default: `STREAMLOAD_PEERS_UNVERIFIED=ture` must not
quietly mean "no", nor `STREAMLOAD_PEER_TIMEOUT=5s` quietly mean 5. An empty value counts as unset.

True/false has one reading (`truth`): 1, true, yes, on or 0, false, no, off, in any case. Other libraries'
switches that streamload honours (`HF_HUB_OFFLINE`, `HF_HUB_DISABLE_PROGRESS_BARS`, `TQDM_DISABLE`) are read as
their library reads them (`switched_on`: the same spellings mean on, anything else off, nothing refused): they are
theirs to define. docs/defaults.md lists them all.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from streamload.base.errors import StreamloadError

T = TypeVar("T")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class SettingError(StreamloadError, ValueError):
    """A variable set to a value streamload cannot read; the message names the variable and the value."""


def truth(name: str, raw: str) -> bool:
    """`raw`, the value of `name`, as true or false: one of `TRUE` or `FALSE` in any case; anything else is refused."""
    said = raw.strip().lower()
    if said in TRUE:
        return True
    if said in FALSE:
        return False
    raise SettingError(f"{name}={raw!r}: give {', '.join(TRUE)} (on) or {', '.join(FALSE)} (off)")


def switched_on(raw: str | None) -> bool:
    """Another library's switch, read as huggingface_hub reads its own: on for `TRUE`'s spellings, anything else
    off. Never refused: the variable is that library's, and it accepts whatever it is set to."""
    return (raw or "").strip().lower() in TRUE


def _count(name: str, raw: str) -> int:
    if not raw.strip().isdecimal():  # the digits `int` reads, no sign: a whole number, 0 or more
        raise SettingError(f"{name}={raw!r}: give a whole number, 0 or more")
    return int(raw)


def _float(raw: str) -> float:
    """`raw` as a number; NaN (which every range check refuses) for text that is none."""
    try:
        return float(raw.strip())
    except ValueError:
        return math.nan


def _seconds(name: str, raw: str) -> float:
    """Seconds, more than 0 and finite (a timeout: 0 or infinity would be no bound the clients can take)."""
    if not (0 < (s := _float(raw)) < math.inf):  # also NaN
        raise SettingError(f"{name}={raw!r}: give seconds, more than 0")
    return s


def _delay(name: str, raw: str) -> float:
    """Seconds, 0 or more (infinity: never)."""
    if not (s := _float(raw)) >= 0:  # also NaN
        raise SettingError(f"{name}={raw!r}: give seconds, 0 or more")
    return s


def _text(name: str, raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One variable: `kind` and `meaning` as docs/defaults.md gives them; `parse` turns a set, non-empty value into
    `T` or raises SettingError."""

    name: str
    kind: str
    default: T
    meaning: str
    parse: Callable[[str, str], T]

    def get(self) -> T:
        """The value now (unset or empty: the default)."""
        raw = os.environ.get(self.name, "")
        return self.parse(self.name, raw) if raw.strip() else self.default

    def put(self, value: str) -> None:
        """Set it for this process and the processes it starts (the settings streamload hands to a child)."""
        os.environ[self.name] = value

    def clear(self) -> None:
        os.environ.pop(self.name, None)


# -- object stores and HTTP servers (storage/remote.py) ---------------------------------------------------
TIMEOUT: Setting[float] = Setting(
    "STREAMLOAD_TIMEOUT", "seconds", 30.0,
    "seconds each request to an object store or HTTP server may take, per attempt", _seconds,
)  # fmt: skip
RETRIES: Setting[int] = Setting(
    "STREAMLOAD_RETRIES", "count", 4,
    "retries of a request that failed or got no answer, with backoff (each request makes RETRIES + 1 attempts)",
    _count,
)  # fmt: skip
ALLOW_UNVALIDATED: Setting[bool] = Setting(
    "STREAMLOAD_ALLOW_UNVALIDATED", "true/false", False,
    "load from a server that gives no strong ETag (refused otherwise): one warning; a change during the load is "
    "seen only where it moves the size or Last-Modified (or by verify=True with a digest file)", truth,
)  # fmt: skip

# -- peers (storage/peers.py, storage/peer_proof.py, servers/seed.py) -------------------------------------
PEER_TIMEOUT: Setting[float] = Setting(
    "STREAMLOAD_PEER_TIMEOUT", "seconds", 5.0,
    "seconds a peer may take to connect, or between bytes (more than 0; at least 0.05 is used)", _seconds,
)  # fmt: skip
PEERS_UNVERIFIED: Setting[bool] = Setting(
    "STREAMLOAD_PEERS_UNVERIFIED", "true/false", False,
    "use peers for files whose source publishes no digests, their bytes unchecked (never kept in a cache)", truth,
)  # fmt: skip
PEER_CA: Setting[str | None] = Setting(
    "STREAMLOAD_PEER_CA", "path", None,
    "the CA certificates (PEM) https:// peers are checked against (unset: the system's store)", _text,
)  # fmt: skip
PEER_TOKEN: Setting[str | None] = Setting(
    "STREAMLOAD_PEER_TOKEN", "text", None,
    "the peers' shared secret: proofs are made with it, and a seeder refuses those made without it", _text,
)  # fmt: skip
PEER_TOKEN_FILE: Setting[str | None] = Setting(
    "STREAMLOAD_PEER_TOKEN_FILE", "path", None,
    "a file whose first line is the peers' token (before STREAMLOAD_PEER_TOKEN; `--token-file` before both)", _text,
)  # fmt: skip

# -- the progress bar (base/progress.py) ------------------------------------------------------------------
PROGRESS_AFTER: Setting[float] = Setting(
    "STREAMLOAD_PROGRESS_AFTER", "seconds", 1.0,
    "seconds a load runs before its progress bar is drawn on a terminal (0: from the start)", _delay,
)  # fmt: skip

# -- set by streamload for the processes it starts --------------------------------------------------------
FETCH: Setting[str | None] = Setting(
    "STREAMLOAD_FETCH", "JSON", None,
    "a fetch started ahead of an engine (`streamload serve`, `streamload.integrations.startup.prefetch.ahead`), "
    "which streamload's vLLM load format in that process or a child adopts once; written by streamload, not by hand",
    _text,
)  # fmt: skip
VLLM_CHECK: Setting[str | None] = Setting(
    "STREAMLOAD_VLLM_CHECK", "path", None,
    "in a vLLM process: a folder where each rank writes its tensors' digests after loading "
    "(`streamload.integrations.vllm.check` sets it for the engines it starts)", _text,
)  # fmt: skip

ALL: tuple[Setting[Any], ...] = (
    TIMEOUT, RETRIES, ALLOW_UNVALIDATED, PEER_TIMEOUT, PEERS_UNVERIFIED, PEER_CA, PEER_TOKEN, PEER_TOKEN_FILE,
    PROGRESS_AFTER, FETCH, VLLM_CHECK,
)  # fmt: skip

__all__ = ["ALL", "FALSE", "TRUE", "Setting", "SettingError", "switched_on", "truth"]
