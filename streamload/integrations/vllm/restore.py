"""A reload that fails leaves the weights it found, on every rank of the engine.

vLLM's in-place reload (`reload_weights(weights_path=...)`, the weight-transfer engine's updates)
empties each layer onto meta, and fills and processes it as its weights arrive, in place. A stream
that fails mid-way (a damaged byte caught by `verify`, a shard gone or cut short, a store refusing)
would leave the layers already filled with the new weights and the others on meta: a dead engine.
So the reload's feed (`StreamloadModelLoader.get_all_weights`) ends, on every rank, with a vote (one
all-reduce on vLLM's CPU world group: every pipeline stage and every tensor, expert and data parallel
rank, since a stage that kept new weights while another put old ones back would serve a mix); where
any rank failed, every rank puts
its layers back (vLLM's own finalisation), reads the weights it served before over them if anything
had arrived, and raises the error. Every parameter keeps its storage, so the engine serves the
previous weights at the same addresses.

The error is raised by the engine's last rank only, naming every rank's reason (the others log
it and return, their weights restored): vLLM's executor reads the workers' replies to a call in rank
order and stops at the first failure, leaving the later replies queued as the answers to the next
call (vLLM 0.32, `MultiprocExecutor.collective_rpc`), so a failure raised by every rank, or by a
rank before the last, would make the engine's next call fail with a stale error.

With `cooperative`, a rank that fails while its peers still exchange batches with it votes while they
wait in an exchange on the same group: they give up on it after the exchange's deadline and read its
share themselves (exchange.py) before they vote; the vote itself is not guarded against that
interleaving on every backend (tested: plain tensor parallelism).

A peer that never votes (its process died, or it hangs) fails the vote: gloo sees a dead peer's
connections close at once (~30 ms measured), and gives up on a live one that does not answer after
the group's timeout (vLLM's `cpu_distributed_timeout_seconds`; torch's default for gloo is 30
minutes). That timeout is the vote's bound: ranks legitimately reach the vote far apart (one still
streaming its larger share), so no shorter bound is safe. A rank whose vote was lost asks its peers
nothing more (a second collective on a broken group raises or waits as long again): it puts its
layers back, reads the previous weights over them, and raises (every such rank: the engine has lost
a worker, so the rank-order reasoning above no longer holds).

The previous weights are read again only from the very files that were loaded: each load records
every file's identity (size, and inode and mtime for a local file, ETag or Last-Modified for an
object) and, where `verify` checked it, its digests (`Loaded`); a restore finds the files again,
reads their headers only and refuses, naming each file and what changed, before reading a byte of
tensor data. (The storage checks every later read against the identity its header was read with, so
a file changed after that check fails the read, not the weights.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, NamedTuple
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import nn

from streamload.format import FileHeader
from streamload.source import Checkpoint

if TYPE_CHECKING:
    from streamload.verify import Known


@dataclass(frozen=True)
class Loaded:
    """One file as a load read it: enough to tell, before reading it again, that it is another now."""

    path: str
    size: int
    version: tuple[object, ...]  # a local file: (device, inode, mtime_ns); an object: ("etag" | "modified", value)
    digest: str = ""  # what `verify` checked it against (see `_fingerprint`); "" where it checked nothing

    @staticmethod
    def of(header: FileHeader, kind: str, digest: str = "") -> Loaded:
        """From a header's identity (storage/local.py: device, inode, size, mtime; remote.py: size, kind, tag)."""
        identity = header.identity
        if kind == "local" and len(identity) == 4:
            version: tuple[object, ...] = (identity[0], identity[1], identity[3])
        else:
            version = tuple(identity[1:])
        return Loaded(str(header.path), header.size, version, digest)

    def change(self, now: Loaded | None) -> str:
        """What differs in `now` (this file as found to read it again; None: not found), or ""."""
        if now is None:
            return f"{self.path}: no longer among the checkpoint's files"
        what = []
        if now.size != self.size:
            what.append(f"{self.size} bytes when loaded, {now.size} now")
        what += _version_change(self.version, now.version)
        if now.digest != self.digest:
            what.append(f"digest {self.digest or 'none'} when loaded, {now.digest or 'none'} now")
        return f"{self.path}: {', '.join(what)}" if what else ""


def _version_change(then: tuple[object, ...], now: tuple[object, ...]) -> list[str]:
    if then == now:
        return []
    if len(then) == len(now) == 3:  # local: (device, inode, mtime_ns)
        what = []
        if then[:2] != now[:2]:
            what.append(f"replaced by another file (inode {then[1]} when loaded, {now[1]} now)")
        if then[2] != now[2]:
            what.append(f"modified (mtime {_when(then[2])} when loaded, {_when(now[2])} now)")
        return what
    if len(then) == len(now) == 2 and then[0] == now[0]:  # an object: ETag or Last-Modified
        label = "ETag" if then[0] == "etag" else "Last-Modified"
        return [f"{label} {then[1]} when loaded, {now[1]} now"]
    return [f"version {then} when loaded, {now} now"]  # read from elsewhere (a cached copy, the store)


def _when(ns: object) -> str:
    return datetime.fromtimestamp(int(ns) / 1e9, timezone.utc).isoformat() if isinstance(ns, int) else str(ns)


def loaded_files(checkpoints: Iterable[Checkpoint], verify: Any = False) -> tuple[Loaded, ...]:
    """Every file of `checkpoints` as read (their headers' identities), with the digests a load with
    `verify=` checks them against (only headers and digest files are read, no tensor data)."""
    out: list[Loaded] = []
    for checkpoint in checkpoints:
        digests = _digests(checkpoint, verify)
        kind = checkpoint.storage.kind
        out += (Loaded.of(h, kind, digests.get(h.path, "")) for h in checkpoint.files)
    return tuple(out)


def _digests(checkpoint: Checkpoint, verify: Any) -> dict[PurePath, str]:
    """{file: fingerprint} of the digests `verify=` checks the checkpoint against, as known now."""
    if not verify:
        return {}
    from streamload import verify as verifying

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
    files read (`files`: what a restore refuses to read again if any changed)."""

    where: str
    model: str
    model_weights: str
    revision: str | None
    files: tuple[Loaded, ...] = ()
    verify: Any = False  # the load's `verify` option: the digests recorded are the ones it checked

    @staticmethod
    def of(where: str, model_config: Any, checkpoints: Iterable[Checkpoint] = (), verify: Any = False) -> Served:
        files = loaded_files(checkpoints, verify)
        return Served(
            where, model_config.model, getattr(model_config, "model_weights", ""), model_config.revision, files, verify
        )

    def changes(self, checkpoints: Iterable[Checkpoint]) -> list[str]:
        """Each file of `checkpoints` (the same source, found again) that is not as it was loaded, and
        what changed; each file loaded then that is gone."""
        now = {f.path: f for f in loaded_files(checkpoints, self.verify)}
        out = [c for f in self.files if (c := f.change(now.get(f.path)))]
        then = {f.path for f in self.files}
        return out + [f"{path}: not among the files loaded then" for path in now if path not in then]

    def put_back(self, model_config: Any) -> None:
        """The config's fields as they were (vLLM's reload pointed them at the failed path)."""
        model_config.model, model_config.revision = self.model, self.revision
        if hasattr(model_config, "model_weights"):
            model_config.model_weights = self.model_weights


SERVED: WeakKeyDictionary[nn.Module, Served] = WeakKeyDictionary()


class Ranks:
    """Every rank of the engine: all pipeline stages, tensor, expert and data parallel ranks (vLLM's
    world group), which reload together and so decide together. A stage whose reload failed puts its
    layers back; one that succeeded must too, or the engine serves old layers before new ones."""

    def __init__(self, group: Any | None) -> None:
        self._group = group  # a torch.distributed group of them all (CPU), or None: a rank alone
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world = 1 if group is None else dist.get_world_size(group)

    @staticmethod
    def of_engine() -> Ranks:
        """vLLM's world group (None outside an engine: a model built alone)."""
        if not dist.is_initialized():
            return Ranks(None)
        from vllm.distributed import get_world_group

        return Ranks(get_world_group().cpu_group)

    @property
    def last(self) -> bool:
        """The rank that raises a failed reload's error (the module's docstring: why only one)."""
        return self.rank == self.world - 1

    def vote(self, ok: bool, touched: bool) -> tuple[bool, bool]:
        """(ok on every rank, touched on any): one collective, which every rank makes once per reload,
        at its end, whatever happened before. Raises where a peer never votes (the module's docstring:
        bounded by the group's timeout)."""
        if self.world == 1:
            return ok, touched
        flags = torch.tensor([0 if ok else 1, int(touched)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return not flags[0].item(), bool(flags[1].item())

    def reasons(self, why: str) -> list[str]:
        """Every rank's reason for a failed reload ("" where it had none), after a failed vote that
        every rank made."""
        if self.world == 1:
            return [why]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, why, group=self._group)
        return [str(r or "") for r in every]

    def decide(self, why: str | None, touched: bool) -> Decision:
        """The vote (`why`: this rank's failure, None if it had none), and every rank's reasons where it
        failed. Never raises: a vote lost with a peer decides "failed, maybe touched" on this rank
        alone, and asks nothing more of the group (`Decision.lost`)."""
        mine = why or ""
        alone = ["" if r != self.rank else mine for r in range(self.world)]
        try:
            ok, touched = self.vote(why is None, touched)
        except Exception as exc:  # a peer that never voted: its weights are unknown, so are ours to it
            return Decision(False, True, alone, f"the engine's ranks could not vote ({_short(exc)})")
        if ok:
            return Decision(True, touched, [])
        try:
            return Decision(False, touched, self.reasons(mine))
        except Exception as exc:  # a peer lost after the vote: the decision stands, its reason is unknown
            return Decision(False, touched, alone, f"the engine's ranks could not share their reasons ({_short(exc)})")


class Decision(NamedTuple):
    """What the engine's ranks decided at the end of a reload (`Ranks.decide`)."""

    ok: bool
    touched: bool  # new weights reached some layer on some rank (or may have: a lost vote)
    reasons: list[str]  # every rank's reason ("" where none); only this rank's where the vote was lost
    lost: str = ""  # why the ranks could not decide together (a peer gone, or past the group's timeout)


def _short(exc: BaseException) -> str:
    """A collective's error in one line (gloo's carry a source location and a long hint)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("] ", 1)[-1].split(" This is typically", 1)[0][:300]


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
