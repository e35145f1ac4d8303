"""What a failed reload puts back (reload.py decides when): the weights served before, read again from
the very files a load read, and vLLM's own end of a layerwise reload.

Each load records every file's identity (size, inode and mtime, or an object's ETag, ...) and, where
`verify` checked it, its digests (`Loaded`, `Served`); a restore reads the files' headers again and
refuses, naming each file and what changed, before reading a byte of tensor data. (The storage checks
every later read against the identity its header was read with: a later change fails the read.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import PurePath
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

from streamload.format.header import LABELS, FileVersion
from streamload.plan.checkpoint import Checkpoint

if TYPE_CHECKING:
    from streamload.pipeline.verify import Known


@dataclass(frozen=True)
class Loaded:
    """One file as a load read it: enough to tell, before reading it again, that it is another now."""

    path: str
    size: int
    version: FileVersion | None  # as its storage told it: a local file's inode and mtime, an object's ETag, ...
    digest: str = ""  # what `verify` checked it against (see `_fingerprint`); "" where it checked nothing

    def change(self, now: Loaded | None) -> str:
        """What differs in `now` (this file found again; None: not found), or ""."""
        if now is None:
            return f"{self.path}: no longer among the checkpoint's files"
        what = []
        if now.size != self.size:
            what.append(f"{self.size} bytes when loaded, {now.size} now")
        what += _version_change(self.version, now.version)
        if now.digest != self.digest:
            what.append(f"digest {self.digest or 'none'} when loaded, {now.digest or 'none'} now")
        return f"{self.path}: {', '.join(what)}" if what else ""


def _version_change(then: FileVersion | None, now: FileVersion | None) -> list[str]:
    if then is None or now is None or then == now:
        return []
    if (then.inode is None) != (now.inode is None):  # read from elsewhere (a cached copy, the store)
        return [f"version ({then}) when loaded, ({now}) now"]
    what = []
    if (then.device, then.inode) != (now.device, now.inode):
        what.append(f"replaced by another file (inode {then.inode} when loaded, {now.inode} now)")
    if then.mtime_ns != now.mtime_ns:
        what.append(f"modified (mtime {_when(then.mtime_ns)} when loaded, {_when(now.mtime_ns)} now)")
    for field in ("etag", "weak", "modified", "generation", "content"):  # an object's
        if (was := getattr(then, field)) != (is_now := getattr(now, field)):
            what.append(f"{LABELS[field]} {was} when loaded, {is_now} now")
    return what


def _when(ns: object) -> str:
    return datetime.fromtimestamp(int(ns) / 1e9, timezone.utc).isoformat() if isinstance(ns, int) else str(ns)


def loaded_files(checkpoints: Iterable[Checkpoint], verify: Any = False) -> tuple[Loaded, ...]:
    """Every file of `checkpoints` as read, with the digests a load with `verify=` checks them against
    (only headers and digest files are read)."""
    out: list[Loaded] = []
    for checkpoint in checkpoints:
        digests = _digests(checkpoint, verify)
        out += (Loaded(str(h.path), h.size, h.identity, digests.get(h.path, "")) for h in checkpoint.files)
    return tuple(out)


def _digests(checkpoint: Checkpoint, verify: Any) -> dict[PurePath, str]:
    """{file: fingerprint} of the digests `verify=` checks the checkpoint against, as known now."""
    if not verify:
        return {}
    from streamload.pipeline import verify as verifying

    try:
        if isinstance(verify, Mapping):  # the caller's own digests
            known = verifying.choose(checkpoint, verify)
        else:  # the checkpoint's: its digest file, a hub cache's blob names, S3 ETags
            known = verifying.known_digests(checkpoint, strict=False)
    except Exception:  # a digest file unreadable now: no digests known (a change, where there were some)
        return {}
    return {path: _fingerprint(k) for path, k in known.items()}


def _fingerprint(known: Known) -> str:
    """Per-tensor block digests (what `verify` checks where it has them) as one hash, else the whole file's."""
    if known.blocks is not None:
        doc = json.dumps([known.block_bytes, known.header_sha256, known.blocks], sort_keys=True)
        return f"blocks:{hashlib.sha256(doc.encode()).hexdigest()[:16]} ({known.origin})"
    return f"{known.whole.algorithm}:{known.whole.hex} ({known.whole.origin})" if known.whole else ""


@dataclass(frozen=True)
class Served:
    """Where a model's current weights came from (`where`, resolved), its config's fields then, and the
    files read."""

    where: str
    model: str
    model_weights: str
    revision: str | None
    files: tuple[Loaded, ...] = ()
    verify: Any = False  # the load's `verify` option: the digests recorded are the ones it checked

    @staticmethod
    def of(where: str, model_config: Any, checkpoints: Iterable[Checkpoint] = (), verify: Any = False) -> Served:
        files = loaded_files(checkpoints, verify)
        return Served(where, model_config.model, model_config.model_weights, model_config.revision, files, verify)

    def changes(self, checkpoints: Iterable[Checkpoint]) -> list[str]:
        """Each file of `checkpoints` (the same source, found again) not as it was loaded, and how."""
        now = {f.path: f for f in loaded_files(checkpoints, self.verify)}
        out = [c for f in self.files if (c := f.change(now.get(f.path)))]
        then = {f.path for f in self.files}
        return out + [f"{path}: not among the files loaded then" for path in now if path not in then]

    def put_back(self, model_config: Any) -> None:
        """The config's fields as they were (vLLM's reload pointed them at the failed path)."""
        for name in ("model", "model_weights", "revision"):
            setattr(model_config, name, getattr(self, name))


SERVED: WeakKeyDictionary[nn.Module, Served] = WeakKeyDictionary()


def put_back_layers(model: nn.Module, model_config: Any) -> None:
    """vLLM's own end of a layerwise reload: layers nothing arrived for get their old tensors back,
    layers filled in part are processed as they are (the previous weights are read over them after)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def reload_over(model: nn.Module, model_config: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """A whole layerwise reload of `weights`, in place, as vLLM's `reload_weights` makes one."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    put_back_layers(model, model_config)
