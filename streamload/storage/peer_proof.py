"""Who may read from a seeder: a peer proves, with each request, that it could read the object from its origin.

The proof is an HMAC-SHA256 keyed by what only a reader of the origin knows: the SHA-256 of the object's
header bytes (the length word and the JSON header, read from the origin by every load before a byte of data)
and the version tag both sides name the object's version by (`peers.version_tag`), plus the cluster's shared
secret where one is set (`STREAMLOAD_PEER_TOKEN`, or a file's first line: `STREAMLOAD_PEER_TOKEN_FILE`). It
covers a fresh nonce, the time, the method, the path and the range, so a request seen on the path cannot be
replayed (the seeder remembers the nonces of the last `WINDOW` seconds) nor turned into another request.

    X-Streamload-Proof: t=<unix seconds>, n=<32 hex digits>, p=<64 hex digits>

A seeder holds the copy, so it knows the header and the version; a co-tenant who reaches the port but never
read the object from its origin does not, and gets 403. What it does not hide: the bytes themselves from an
observer on the path (TLS does: a seeder's certificate and key, `https://` peers), and that a node holds some
object at a path (404 and 403 differ only in what was asked).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

from streamload.base import settings

HEADER = "X-Streamload-Proof"
WINDOW = 120.0  # seconds a proof's time may differ from the seeder's clock (and a nonce is remembered)
REMEMBERED = 1 << 18  # nonces kept at most (~2,000 requests a second; past it, new proofs are refused)
_VALUE = re.compile(r"t=(\d{1,12}),\s*n=([0-9a-f]{32}),\s*p=([0-9a-f]{64})")


def token(path: str | os.PathLike[str] | None = None) -> bytes | None:
    """The cluster's shared secret: the first line of `path` (`--token-file`), else of the file
    `STREAMLOAD_PEER_TOKEN_FILE` names, else `STREAMLOAD_PEER_TOKEN`; None where none is set. Raises
    ValueError naming a file that cannot be read or is empty."""
    path = path or settings.PEER_TOKEN_FILE.get()
    if path is not None:
        try:
            text = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the peers' token: {exc}") from None
        if not text or not text[0].strip():
            raise ValueError(f"{path}: the peers' token file is empty")
        return text[0].strip().encode()
    value = settings.PEER_TOKEN.get()
    return value.encode() if value else None


def read_key(header_prefix: bytes, tag: str, secret: bytes | None) -> bytes:
    """The key proofs for one object version are made with: only a reader of its origin (and, with a
    secret, a member of the cluster) can compute it."""
    message = b"streamload-peer-read/1\n" + tag.encode() + b"\n" + (secret or b"")
    return hmac.new(hashlib.sha256(header_prefix).digest(), message, hashlib.sha256).digest()


def _mac(key: bytes, when: int, nonce: str, method: str, path: str, span: str) -> str:
    signed = f"{when}\n{nonce}\n{method}\n{path}\n{span}".encode()
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def proof(key: bytes, method: str, path: str, span: str = "") -> str:
    """The header value proving a request (`span`: its Range header's value, "" for none)."""
    when, nonce = int(time.time()), secrets.token_hex(16)
    return f"t={when}, n={nonce}, p={_mac(key, when, nonce, method, path, span)}"


class Proofs:
    """A seeder's check of requests' proofs, with the nonces it has seen (thread-safe)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, key: bytes, value: str | None, method: str, path: str, span: str = "") -> str | None:
        """None where `value` proves this request; else why not (a 403's reason)."""
        match = _VALUE.fullmatch((value or "").strip())
        if match is None:
            return "no proof of reading the origin" if not value else "a malformed proof"
        when, nonce, mac = int(match[1]), match[2], match[3]
        now = time.time()
        if abs(now - when) > WINDOW:
            return f"a proof {now - when:.0f} s old (clocks more than {WINDOW:g} s apart?)"
        if not hmac.compare_digest(mac, _mac(key, when, nonce, method, path, span)):
            return "a proof that does not match this object's version"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - WINDOW:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "a proof already used (a replay)"
            if len(self._seen) >= REMEMBERED:  # forgetting a nonce still in its window would let it be replayed
                return f"more than {REMEMBERED} proofs in {WINDOW:g} s"
            self._seen[nonce] = now
        return None


__all__ = ["HEADER", "WINDOW", "Proofs", "proof", "read_key", "token"]
