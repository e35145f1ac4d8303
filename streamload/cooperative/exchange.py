"""Cooperative loading: ranks that need the same bytes each read a share and all-gather the rest.

Every rank of the process group builds the same shared batches (plan/plan.py packs them apart from what
a rank reads for itself). For each one, rank r reads the r-th of `world` equal parts of the slot's
bytes, then one `all_gather_single` into the slot itself leaves the whole batch on every rank: storage
sees each byte once. The pipeline instantiates batches strictly in plan order, one at a time, and
exchanges a shared batch just before instantiating it, so every rank issues the same collectives in
the same order while later batches are still being read.

Where the bytes meet: a gloo group exchanges host slots; an NCCL group exchanges device memory: a
device slot in place, or a host slot through one device buffer of a slot's size (the only extra
memory the exchange takes).

A rank that fails, stops early or hangs must be an error on the others, not a hang: every collective is
waited for with a deadline a little shorter than the process group's own timeout. An NCCL collective
that misses it would otherwise spin on the GPU until NCCL's watchdog ends the whole process; the
exchange aborts the group's communicators instead (the group is unusable afterwards, as after any NCCL
timeout).

A lost rank costs the others time, not the load: once an exchange fails (a rank died, its link broke,
or it did not answer in time), the survivors form a new group without it, through the process
group's own store (torch's TCPStore, where `init_process_group` put it): each says it is alive there
(a rank still waiting in an exchange sees that and stops waiting), the first to decide writes who
answered until none more came for `GRACE` seconds, and those build a gloo group of their own. The
batches read under the old group are completed from the survivors' parts, the lost rank's part read
from storage by the survivors, a share each; later batches are divided among the survivors.
So storage serves the lost rank's share once, not once per survivor. Where no new group can be
formed (an NCCL group, a group other than the default one, the store gone with rank 0, a second
failure), each rank reads what the others would have shared from storage itself. A warning names
the lost ranks. Only when storage cannot serve those bytes either is the load an error.

A rank that leaves on purpose says so: a stream closed before its end (a `break`, an exception in the
loop) or an iter() that failed (a bad argument on that rank only) leaves word in the group's store of
how many steps (the plan's agreement, then each shared batch) it took part in. The others look there
while they wait (every ~0.1 s) and stop waiting for it at once, as for a lost rank, instead of after the
deadline. Only a fleet not yet joined cannot be told (its rendezvous waits for every member).

The ranks also agree that they read the same bytes, not only the same layout: see "which bytes" below.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from streamload.base.errors import StreamloadError, UnsupportedError
from streamload.device import Delivered, Device, DeviceKind, kind_of
from streamload.format.header import FileHeader, FileVersion
from streamload.plan.checkpoint import Checkpoint
from streamload.plan.plan import Batch, Item
from streamload.read import Reader, Work

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

    from streamload.cooperative.fleet import Fleet

    Read = Callable[[Batch], None]  # reads a window of a batch into its slot, blocking

log = logging.getLogger("streamload")

# The share of the process group's timeout the exchange waits for a collective: it must act before
# NCCL's watchdog (which checks the same timeout) tears the process down.
DEADLINE_SHARE = 0.8
GRACE = 1.0  # seconds survivors wait, after the last one said it is alive, for more
_LOADS = itertools.count()  # cooperative loads of this process: every rank counts them alike


def all_gather(output: torch.Tensor, part: torch.Tensor, group: ProcessGroup | None = None) -> Work:
    """Start gathering every rank's equal-sized `part`, concatenated into `output` (in place when
    `part` is its own slice of `output`); returns the collective's work handle.
    `all_gather_single` where torch has it, its older name elsewhere."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, part, group=group, async_op=True)


def group_timeout(group: ProcessGroup | None, device: torch.device) -> timedelta:
    """The timeout the process group's backend for `device` was created with (torch's default where
    the backend does not tell)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    try:
        timeout = pg._get_backend(device).options._timeout
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError):
        pass
    nccl = getattr(dist, "default_pg_nccl_timeout", None)  # NCCL's is shorter (its watchdog acts on it)
    on_nccl = kind_of(device).collective_backend == "nccl"
    return nccl if on_nccl and isinstance(nccl, timedelta) else dist.default_pg_timeout


def wait(work: Work, deadline: float, abort: Any, given_up: Callable[[], bool] | None = None) -> None:
    """Block until `work` completes; past `deadline` (a `time.monotonic()` value) call `abort(work)` and
    raise TimeoutError, as once `given_up()` says the other ranks gave up on it (asked every ~0.1 s).
    The backend's own error, if the collective failed, is raised as it is."""
    pause = 50e-6
    asked = time.monotonic()
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            abort(work)
            raise TimeoutError("no answer from the other ranks in time")
        if given_up is not None and now - asked > 0.1:
            asked = now
            if given_up():  # not aborted: no rank sends on this group again, so nothing more can land
                raise TimeoutError("the other ranks gave up on this exchange (a rank was lost)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)  # quick collectives are seen quickly, long ones cost no CPU
    work.wait()


# -- which bytes ---------------------------------------------------------------------------------
# The ranks' plans agree on names, dtypes, shapes and offsets; each file must also be the same bytes on
# every rank. A file's version, as the storage names it without reading data, settles most cases at no
# cost: one file on one host (its host's identity, device, inode, size and mtime), one file on a network
# file system every host mounts (the file system's type, source and server, inode, size and mtime), or
# one URL, size and ETag (one object version). A local version names its host: hosts made from one image
# have files of equal device, inode, size and mtime that need not hold equal bytes (see `_host_identity`,
# `_shared_file_system`). Where ranks name different versions (a copy on each host's own
# disk, another URL), the versions prove nothing either way: the ranks compare what they read of each
# file (its size, header, the first and last 64 KiB of its data and 4 KiB at 6 points between) and the
# digests known of it (`streamload.digests.json`, a hub cache's blob name, an S3 MD5 ETag). Identical
# copies agree and load together; a file whose sampled bytes differ, or whose digests of one kind differ,
# is refused, naming each rank's file: ranks mixing two versions hand out tensors of neither. A change
# that leaves every sampled byte alone is told only by digests (written by `streamload digest`).
ENDS = 64 << 10  # bytes of a file's data sampled at each end
PROBES, PROBE = 6, 4 << 10  # and blocks of this size between them


def version(header: FileHeader, checkpoint: Checkpoint, mounts: dict[int, tuple[str, ...]] | None = None) -> bytes:
    """32 bytes naming the version of a file as its storage identifies it, without reading data:
    equal on two ranks means the same bytes; different proves nothing (copies). `mounts`: this host's
    network file systems (`_network_mounts`), read once for all files."""
    if checkpoint.storage.local:
        named = _local_version(header.identity, mounts)
    else:  # an ETag names a version of one URL's object (a server on the loopback is each host's own)
        named = (str(header.path), header.identity, *_loopback_host(str(header.path)))
    return hashlib.sha256(repr((header.size, named)).encode()).digest()


def _local_version(identity: FileVersion | None, mounts: dict[int, tuple[str, ...]] | None) -> tuple[object, ...]:
    """A local file's version: on a network file system, its server's inode number, size and mtime
    (the same on every host that mounts it; the device number is each host's own); else its host's
    identity with its device, inode, size and mtime. Without an identity, one no other rank names."""
    if identity is None or identity.device is None:
        return ("unknown", secrets.token_hex(16))
    device, inode, size, mtime = identity.device, identity.inode, identity.size, identity.mtime_ns
    shared = _shared_file_system(device, mounts)
    if shared is not None:
        return ("shared", *shared, inode, size, mtime)
    return ("host", _host_identity(), device, inode, size, mtime)


_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_PROCESS = secrets.token_hex(16)  # this process's own, where the host has no boot id to read


@functools.lru_cache(maxsize=1)
def _host_identity() -> str:
    """Which host this is: the kernel's boot id (random at each boot, so hosts made from one image or
    one disk snapshot still differ; containers on one host share it, as they share its files) and the
    host name. Where there is no boot id (not Linux), this process's own token: every rank then
    compares the bytes of each file, as for copies."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}/{socket.gethostname()}" if boot else _PROCESS


# File systems whose inode numbers and times are the server's, seen alike by every host that mounts them
# (a FUSE file system's inode numbers are its daemon's, on each host; CIFS's may be the client's).
NETWORK_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "ceph", "lustre", "gpfs", "beegfs"})


def _shared_file_system(device: int, mounts: dict[int, tuple[str, ...]] | None = None) -> tuple[str, ...] | None:
    """The network file system of device number `device` (its type, source and server address), or
    None where it is not one (a host's own)."""
    return (_network_mounts() if mounts is None else mounts).get(device)


_MOUNTINFO = "/proc/self/mountinfo"


def _network_mounts() -> dict[int, tuple[str, ...]]:
    """This host's network file systems by device number, from /proc/self/mountinfo: (type, source,
    server address); none where it cannot be read. `addr=` (NFS) tells two servers exported under one
    name apart."""
    out: dict[int, tuple[str, ...]] = {}
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        mount, _, system = line.partition(" - ")
        fields, about = mount.split(), system.split()
        if len(fields) < 3 or len(about) < 2 or about[0] not in NETWORK_FILE_SYSTEMS:
            continue
        major, _, minor = fields[2].partition(":")
        if not (major.isdigit() and minor.isdigit()):
            continue
        options = about[2].split(",") if len(about) > 2 else []
        server = next((o[5:] for o in options if o.startswith("addr=")), "")
        out[os.makedev(int(major), int(minor))] = (about[0], about[1], server)
    return out


_LOOPBACK = re.compile(r"(?i)^(localhost|127(\.\d{1,3}){3}|\[::1\]|0\.0\.0\.0)$")


def _loopback_host(url: str) -> tuple[str, ...]:
    """The host identity where `url`'s server is on the loopback (each host's own server: its ETags, often
    mtime and size, prove nothing across hosts); nothing else."""
    host = url.partition("://")[2].split("/", 1)[0].rpartition("@")[2]
    host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return (_host_identity(),) if _LOOPBACK.match(host) else ()


def known_claims(checkpoint: Checkpoint, headers: Sequence[FileHeader]) -> list[bytes]:
    """Per file, 32 bytes: its known whole-file digest (8 bytes naming the algorithm, 24 of the digest),
    or zeros where none is known."""
    from streamload.pipeline.verify import known_digests

    known = known_digests(checkpoint, strict=False)
    out = []
    for h in headers:
        whole = known[h.path].whole if h.path in known else None
        if whole is None:
            out.append(bytes(32))
            continue
        kind, value = hashlib.sha256(whole.algorithm.encode()).digest(), hashlib.sha256(whole.hex.encode()).digest()
        out.append(kind[:8] + value[:24])
    return out


def fingerprints(checkpoint: Checkpoint, headers: Sequence[FileHeader]) -> list[bytes]:
    """Per file, the SHA-256 of its size, header and sampled data (a few small reads)."""
    files = checkpoint.storage.open({h.path: h for h in headers})
    try:
        return [_fingerprint(h, files) for h in headers]
    finally:
        files.close()


def _fingerprint(header: FileHeader, files: Any) -> bytes:
    h = hashlib.sha256(f"{header.size}\0".encode())
    spans = []
    if len(header.prefix) == header.data_start:  # the header's bytes as read: no second read
        h.update(header.prefix)
    else:
        spans.append((0, header.data_start))
    start, end = header.data_start, header.size
    step = (end - start) // (PROBES + 1)
    spans += [(start, min(ENDS, end - start)), (max(start, end - ENDS), min(ENDS, end - start))]
    spans += [(start + k * step, min(PROBE, end - start - k * step)) for k in range(1, PROBES + 1) if step]
    for offset, length in spans:
        if length > 0:
            for view in files.read(header.path, offset, length):
                h.update(view)
    return h.digest()


def differ(rows: torch.Tensor) -> str:
    """Why the ranks' (claim, fingerprint) rows of one file (`[world, 2, 32]`) say different bytes, or ""."""
    claims, prints = rows[:, 0], rows[:, 1]
    if not bool((prints == prints[0]).all()):
        return "their sizes, headers or sampled bytes differ"
    known = bool(claims.any(dim=1).all())
    if known and bool((claims[:, :8] == claims[0, :8]).all()) and not bool((claims == claims[0]).all()):
        return "their digests differ"
    return ""


class Left(TimeoutError):
    """Ranks said they left the load (`ranks`: first rank -> the steps they took part in: the plan's
    agreement, then each shared batch) before the step this rank waits in: no answer will come."""

    def __init__(self, ranks: dict[int, int], world: int) -> None:
        super().__init__()
        self.ranks, self.world = ranks, world
        self.waited = 0.0  # seconds this rank waited for them

    def __str__(self) -> str:
        def after(steps: int) -> str:
            return "before agreeing on the plan" if steps == 0 else f"after {steps - 1} shared batch(es)"

        said = "; ".join(f"rank {r} of {self.world} left the load {after(k)}" for r, k in sorted(self.ranks.items()))
        return (
            f"{said} (its stream was closed before the end, or its iter() failed): this rank stopped waiting "
            f"for it after {self.waited:.3g} s"
        )


def leave_early(group: ProcessGroup | Fleet | None) -> None:
    """This rank's iter() failed before it joined a cooperative load (a bad argument, a missing file):
    tells the others at once, where the group has a store, so that they read its share themselves."""
    import torch.distributed as dist

    from streamload.cooperative.fleet import Fleet

    number = next(_LOADS)  # a load all the same: every rank counts them alike
    store, rank = None, 0
    with contextlib.suppress(Exception):  # no store (another group, a fleet not yet joined): nothing to tell
        if isinstance(group, Fleet):
            store, rank = group.joined_store(), group.rank
        elif group is None or group == dist.group.WORLD:
            store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    if store is not None:
        _say_left(store, number, rank, 0)


def _say_left(store: Any, number: int, rank: int, steps: int) -> None:
    """Leave word in the group's store that `rank` (of the first group) took part in `steps` steps of
    load `number` and no more (its value first: whoever sees the count reads it)."""
    with contextlib.suppress(Exception):  # the store may be gone with rank 0: no one is waiting then
        store.set(f"streamload/{number}/left/{rank}", str(steps))
        store.add(f"streamload/{number}/left", 1)


class Exchange:
    """The ranks of `group` (None: the default group) loading the same checkpoint together."""

    def __init__(self, group: ProcessGroup | Fleet | None, device: torch.device) -> None:
        import torch.distributed as dist

        from streamload.cooperative.fleet import Fleet

        self.device = device
        self._buffer: torch.Tensor | None = None
        self._copies: DeviceKind | None = None  # whose copy stream the exchange's copies run on (on_device)
        self.aborted = False
        self.lost: str = ""  # why no group is used any more: this rank then reads alone
        self._backend: Any = None  # a fleet's gloo group, or the survivors' once one was formed
        self._store: Any = None  # the group's store: where survivors of a lost rank meet
        self._number = next(_LOADS)
        self._load = f"{self._number}"
        self._steps = 0  # steps taken part in (the plan's agreement, then each shared batch): alike on all ranks
        self._total: int | None = None  # steps of the whole load, once planned
        self._left: dict[int, int] = {}  # first ranks that said they left -> the steps they took part in
        self._left_seen = 0  # how many had said so when last asked
        self.regrouped = 0  # times a group was formed among survivors
        self._fleet = group if isinstance(group, Fleet) else None
        if isinstance(group, Fleet):  # streamload's own group: gloo, through host slots
            self._store, self._backend = group.join()
            self.group, self._pg = None, self._backend
            self.rank, self.world, self.on_device = group.rank, group.world_size, False
            self.first_world = self.world
            self.timeout = group.timeout
            self.members: tuple[int, ...] = tuple(range(self.world))  # ranks of the first group in the group now
            self.first_rank = self.rank
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("cooperative loading needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = self.first_world = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        # On a device (CUDA), exchange device memory when the group speaks its backend (NCCL); else go
        # through host memory.
        kind = kind_of(device)
        self.on_device = not kind.host_memory and kind.collective_backend in backend
        if not self.on_device and "nccl" in backend and "gloo" not in backend:
            raise UnsupportedError(
                f"cooperative loading to {device} needs a process group that can exchange host memory "
                f"(gloo), not {backend!r}"
            )
        if self.on_device:
            self._copies = kind
        self._pg = group if group is not None else dist.group.WORLD
        self.timeout = group_timeout(group, device if self.on_device else torch.device("cpu"))
        self.members = tuple(range(self.world))
        self.first_rank = self.rank
        if group is None or group == dist.group.WORLD:
            with contextlib.suppress(Exception):  # torch's private accessor: without it, no regrouping
                self._store = dist.distributed_c10d._get_default_store()

    def _collective(self, output: torch.Tensor, part: torch.Tensor) -> None:
        """All-gather `part` into `output`, waited for with a deadline (see the module's docstring)."""
        if self._backend is not None:
            work = self._backend._allgather_base(output, part)
        else:
            work = all_gather(output, part, self.group)
        self._wait(work)

    def _wait(self, work: Work) -> None:
        given_up = self._given_up if self._store is not None else None
        started = time.monotonic()
        try:
            wait(work, started + self.timeout.total_seconds() * DEADLINE_SHARE, self._abort, given_up)
        except Left as exc:
            exc.waited = time.monotonic() - started
            if self.on_device:  # as past the deadline: NCCL would spin on the GPU until its watchdog
                self._abort(work)
            raise
        except TimeoutError as exc:  # the seconds it took (gloo's thread is waited for past the deadline)
            raise TimeoutError(f"{exc} (waited {time.monotonic() - started:.3g} s)") from None

    def _given_up(self) -> bool:
        """Whether other ranks began to regroup (a rank was lost): this rank's exchange will not finish.
        Raises `Left` where a rank said it left the load before this step."""
        self._check_left()
        if self.on_device:  # an NCCL group is never regrouped
            return False
        try:
            return bool(self._store.check([f"{self._regroup_key()}/count"]))
        except Exception:
            return False

    def _check_left(self) -> None:
        """Raises `Left` where members said they left the load before the step this rank is in."""
        key = f"streamload/{self._number}/left"
        try:
            count = self._store.add(key, 0)
            if count > self._left_seen:
                self._left_seen = count
                for r in self.members:
                    if r != self.first_rank and r not in self._left and self._store.check([f"{key}/{r}"]):
                        self._left[r] = int(self._store.get(f"{key}/{r}"))
        except Exception:
            return  # no word from the store: the deadline still holds
        gone = {r: k for r, k in self._left.items() if r in self.members and k <= self._steps}
        if gone:
            raise Left(gone, self.first_world)

    def expect(self, shared_batches: int) -> None:
        """The plan is made: the load is its agreement and `shared_batches` exchanges."""
        self._total = 1 + shared_batches

    def leave(self) -> None:
        """Tell the others this rank takes no part in the rest of the load (its stream was closed before
        the end, or its iter() failed), where it has not taken part in all of it: they stop waiting at once."""
        if self._store is not None and (self._total is None or self._steps < self._total):
            _say_left(self._store, self._number, self.first_rank, self._steps)
            self._total = self._steps  # said once

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        """`t` from rank `root` of the survivors' group to every other (only after a regroup)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        self._wait(self._backend.broadcast([t], options))

    def _abort(self, work: Work) -> None:
        group = self._backend if self._backend is not None else self._pg
        if self.on_device:  # NCCL: a collective that would spin on the GPU until the watchdog ends the process
            group.abort()
            self.aborted = True
            return
        # gloo: its thread may still write into the slot until gloo's own timeout (the other 20%); the
        # slot is given back (to later loads) only once it no longer can.
        with contextlib.suppress(Exception):
            work.wait()

    @property
    def buffers(self) -> int:
        """Slot-sized buffers the exchange may keep besides the ring (for host slots on an NCCL group)."""
        return 1 if self.on_device else 0

    @property
    def padding(self) -> int:
        """Bytes a slot needs beyond the plan's slot size: the last part is rounded up."""
        return self.world

    def _part(self, batch: Batch) -> tuple[int, int]:
        size = -(-batch.extent // self.world)
        return self.rank * size, size

    def own_part(self, batch: Batch) -> Batch:
        """The part of a shared batch this rank reads."""
        lo, size = self._part(batch)
        return batch.window(lo, lo + size)

    def gather(self, batch: Batch, slot: torch.Tensor) -> torch.Tensor:
        """Blocking: every rank's part of `batch` into one buffer (`slot`, or the device buffer), returned."""
        lo, size = self._part(batch)
        target = slot
        with self._copies.copy_stream(self.device) if self._copies is not None else contextlib.nullcontext():
            if self.on_device and slot.is_cpu:  # a host slot (the posix reader's): copied to the device first
                kind_of(self.device).pin_slot(slot, batch.extent)
                if self._buffer is None:
                    self._buffer = torch.empty(slot.numel(), dtype=torch.uint8, device=self.device)
                target = self._buffer
                target[lo : lo + size].copy_(slot[lo : lo + size], non_blocking=True)
            try:
                self._collective(target[: size * self.world], target[lo : lo + size])
            except Exception as exc:
                raise self._failed(batch, exc) from exc
        return target

    def agree(self, checkpoint: Checkpoint, candidates: Sequence[Item], layout: str) -> set[str]:
        """Blocking, collective: the names among `candidates` (tensors this rank reads whole) that every
        rank reads whole. First checks that all ranks load the same checkpoint with the same layout, and
        the same bytes (`_same_files`). A rank that left before agreeing is left out: the others agree
        among themselves (or, alone, read everything themselves)."""
        names = sorted(checkpoint.tensors)
        digest = hashlib.sha256(layout.encode())
        for h in checkpoint.files:  # the files (and their count: what `_same_files` exchanges a token of each)
            digest.update(f"{h.path.name}\0".encode())
        for n in names:
            t = checkpoint.tensors[n]
            digest.update(f"{n}\0{t.path.name}\0{t.dtype.name}\0{t.shape}\0{t.begin}\0{t.end}\0".encode())
        self._load = f"{self._number}-{digest.hexdigest()[:16]}"  # keys of this load in the group's store
        while True:
            try:
                agreed = self._agree(checkpoint, names, digest.digest(), candidates)
                break
            except Left as exc:
                self._regroup(StreamloadError(f"cooperative loading: agreeing on the plan: {exc}"))
                if self.lost:  # alone: every tensor this rank reads, it reads whole itself
                    agreed = {i.name for i in candidates}
                    break
        self._steps += 1
        return agreed

    def _agree(self, checkpoint: Checkpoint, names: list[str], digest: bytes, candidates: Sequence[Item]) -> set[str]:
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        try:
            digests = self._gather_small(mine)
            differ = [self.members[r] for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
            if differ:
                raise StreamloadError(
                    f"cooperative loading: ranks {differ} load a different checkpoint (or ring layout: "
                    f"slot size, order) than rank {self.members[0]}; every rank of the group must call iter() alike"
                )
            self._same_files(checkpoint)
            wanted = {i.name for i in candidates}
            mask = torch.tensor([n in wanted for n in names], dtype=torch.uint8)
            everyone = self._gather_small(mask).min(dim=0).values
        except (StreamloadError, Left):
            raise
        except Exception as exc:
            raise StreamloadError(
                f"cooperative loading: rank {self.rank} of {self.world}: agreeing on the plan with the "
                f"other ranks failed (every rank must call iter() with cooperative loading): {exc}"
            ) from exc
        return {n for n, keep in zip(names, everyone.tolist(), strict=True) if keep}

    def _same_files(self, checkpoint: Checkpoint) -> None:
        """Collective: refuses files that are not the same bytes on every rank (the rules: "Which bytes",
        above): the plan says which bytes of which file name each rank reads, not which file."""
        files = sorted(checkpoint.files, key=lambda h: h.path.name)
        mounts = _network_mounts() if checkpoint.storage.local else {}
        named = b"".join(version(h, checkpoint, mounts) for h in files)
        versions = torch.frombuffer(bytearray(named), dtype=torch.uint8)
        every = self._gather_small(versions).view(self.world, len(files), -1)
        unsure = [i for i in range(len(files)) if not bool((every[:, i] == every[0, i]).all())]
        if not unsure:
            return  # one file (a shared file system), or one object version, for every rank
        headers = [files[i] for i in unsure]
        mine = b"".join(
            c + f for c, f in zip(known_claims(checkpoint, headers), fingerprints(checkpoint, headers), strict=True)
        )
        every = self._gather_small(torch.frombuffer(bytearray(mine), dtype=torch.uint8)).view(
            self.world, len(unsure), 2, -1
        )
        different = {unsure[k]: why for k in range(len(unsure)) if (why := differ(every[:, k]))}
        if different:
            raise StreamloadError(self._different(files, different, every, unsure))

    def _different(
        self, files: list[FileHeader], different: dict[int, str], every: torch.Tensor, unsure: list[int]
    ) -> str:
        """Collective: the refusal of files that differ, naming each rank's file."""
        paths = [text.split("\n") for text in self._gather_text("\n".join(str(files[i].path) for i in different))]
        said = []
        for j, (i, why) in enumerate(different.items()):
            k = unsure.index(i)
            groups: dict[bytes, list[int]] = {}
            for r in range(self.world):
                groups.setdefault(bytes(every[r, k].flatten().tolist()), []).append(r)
            ranks = "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(str(self.members[r]) for r in rs)}: "
                f"{', '.join(sorted({paths[r][j] for r in rs}))}"
                for rs in groups.values()
            )
            said.append(f"{files[i].path.name} ({why}): {ranks}")
        return (
            f"cooperative loading: the ranks were given different files (or versions) of the same layout: "
            f"{' | '.join(said)}; every rank must load the same bytes (identical copies elsewhere are fine), "
            f"or load without cooperative="
        )

    def _gather_text(self, text: str) -> list[str]:
        """Collective: every rank's `text`."""
        raw = text.encode()
        longest = int(self._gather_small(torch.tensor([len(raw)], dtype=torch.int64)).max())
        mine = torch.zeros(max(1, longest), dtype=torch.uint8)
        mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in self._gather_small(mine)]

    def _gather_small(self, t: torch.Tensor) -> torch.Tensor:
        """All ranks' `t`, stacked (on the device the group exchanges)."""
        where = self.device if self.on_device else torch.device("cpu")
        t = t.to(where)
        out = torch.empty((self.world, t.numel()), dtype=t.dtype, device=where)
        self._collective(out.view(-1), t)
        return out.cpu()

    def _failed(self, batch: Batch, exc: Exception) -> StreamloadError:
        names = sorted({p.item.name for p in batch.pieces})
        paths = sorted({str(p.item.info.path) for p in batch.pieces})
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        deadline = self.timeout.total_seconds() * DEADLINE_SHARE
        why = (
            f"{exc}" if isinstance(exc, Left) else
            f"a rank failed, stopped early, or did not answer within {deadline:.3g} s ({DEADLINE_SHARE:.0%} of the "
            f"process group's timeout): {exc}"
        )  # fmt: skip
        return StreamloadError(
            f"{', '.join(paths)}: rank {self.first_rank} of {self.first_world}: exchanging tensors {shown} with the "
            f"other ranks failed; {why}{'; the process group was aborted' if self.aborted else ''}"
        )

    # -- a lost rank ---------------------------------------------------------------------------------
    def complete(self, batch: Batch, slot: torch.Tensor, then: tuple[int, ...], read: Read) -> torch.Tensor:
        """Blocking: `batch`, of which this rank read its part among the ranks `then`, made whole in a
        buffer that is returned — from the others, or, what they cannot give, from storage (`read`)."""
        whole = self._complete(batch, slot, then, read)
        self._steps += 1
        return whole

    def _complete(self, batch: Batch, slot: torch.Tensor, then: tuple[int, ...], read: Read) -> torch.Tensor:
        if self.regrouped and not self.lost:
            self._agree_on(batch, then)
        if not self.lost and then == self.members:
            try:
                return self.gather(batch, slot)  # a collective: in plan order on every rank
            except StreamloadError as exc:
                self._regroup(exc)
                if not self.lost:
                    self._agree_on(batch, then)
        if not self.lost:
            try:
                self._fill(batch, slot, then, read)
                return slot
            except Exception as exc:
                self._lose(f"completing {batch.pieces[0].item.info.path} with the other survivors failed: {exc}")
        size = -(-batch.extent // len(then))
        mine = then.index(self.first_rank) * size
        for window in (batch.window(0, mine), batch.window(mine + size, batch.extent)):
            if window.pieces:
                read(window)
        return slot

    def _agree_on(self, batch: Batch, then: tuple[int, ...]) -> None:
        """After a regroup, the survivors check they complete the same batch the same way: a rank may
        have noticed the loss one batch later than another, or read a batch under the old group that
        another read under the new one. Where they differ, every one of them goes on alone."""
        mine = torch.tensor([batch.index, int(then == self.members)], dtype=torch.int64)
        try:
            every = self._gather_small(mine)
        except Exception as exc:
            self._lose(f"the survivors could not compare their progress: {exc}")
            return
        if not bool((every == every[0]).all()):
            self._lose(f"the survivors were not at the same batch (batch, read by the new group: {every.tolist()})")

    def _fill(self, batch: Batch, slot: torch.Tensor, then: tuple[int, ...], read: Read) -> None:
        """`batch` was read in parts by the ranks `then`: a survivor's part comes from it; a lost rank's
        part is read from storage by the survivors, a share each, and shared."""
        size = -(-batch.extent // len(then))
        for i, first_rank in enumerate(then):
            lo, hi = i * size, min((i + 1) * size, batch.extent)
            if lo >= hi:
                continue
            if first_rank in self.members:
                self._broadcast(slot[lo:hi], self.members.index(first_rank))
                continue
            share = -(-(hi - lo) // self.world)
            for j in range(self.world):
                a, b = lo + j * share, min(hi, lo + (j + 1) * share)
                if a < b:
                    if j == self.rank:
                        read(batch.window(a, b))
                    self._broadcast(slot[a:b], j)

    def _regroup(self, exc: Exception) -> None:
        """The survivors of a failed exchange agree who they are (through the group's store) and form
        a gloo group of their own; where they cannot, this rank goes on alone (`lost`)."""
        import torch.distributed as dist

        if self.on_device or self._store is None:
            self._lose(str(exc))
            return
        key = self._regroup_key()
        try:
            store = self._store
            store.set(f"{key}/alive/{self.first_rank}", b"1")
            seen, since = store.add(f"{key}/count", 1), time.monotonic()
            while seen < len(self.members) - len(self._gone()) and time.monotonic() - since < GRACE:
                time.sleep(0.05)
                now = store.add(f"{key}/count", 0)
                if now != seen:
                    seen, since = now, time.monotonic()
            alive = [r for r in self.members if store.check([f"{key}/alive/{r}"])]
            agreed = store.compare_set(f"{key}/members", "", json.dumps(alive))  # the first to decide wins
            members = tuple(json.loads(agreed))
            if self.first_rank not in members:
                self._lose(f"{exc}; the others went on without this rank")
                return
            rank = members.index(self.first_rank)
            backend = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/group/", store), rank, len(members), self.timeout)
        except Exception as again:
            self._lose(f"{exc}; forming a group of the survivors failed too: {again}")
            return
        lost = sorted(set(self.members) - set(members))
        log.warning(
            "streamload: %s; ranks %s of the first group are lost: %s, reading what the lost ones would have "
            "shared from storage%s", exc, lost, f"{len(members)} ranks go on together" if len(members) > 1 else
            "this rank goes on alone", ", a share each" if len(members) > 1 else "",
        )  # fmt: skip
        self.members, self.rank, self.world, self._backend = members, rank, len(members), backend
        self.regrouped += 1
        if self._fleet is not None:  # its group has lost a member: a later load forms it anew
            self._fleet.forget()

    def _gone(self) -> set[int]:
        """Members that said they left the load before this step (they will not say they are alive)."""
        with contextlib.suppress(Left):
            self._check_left()
        return {r for r, k in self._left.items() if r in self.members and k <= self._steps}

    def _regroup_key(self) -> str:
        return f"streamload/{self._load}/{self.regrouped + 1}"

    def _lose(self, why: str) -> None:
        self.lost = why
        if self._fleet is not None:
            self._fleet.forget()
        log.warning("streamload: %s; this rank reads the rest from storage itself", why)

    def close(self) -> None:
        """Let go of everything of torch.distributed's it holds (the group, the store, a survivors'
        group): a stream kept after the load (`with iter(...) as stream`, then `stream.stats`) must not
        keep them alive past the caller's `destroy_process_group`, nor until the interpreter's exit. The
        others are told where this rank leaves before the end of the load."""
        self.leave()
        self._buffer = self._copies = None
        self._backend = self._store = self._pg = self.group = None


class CooperativeReader:
    """A reader that reads only this rank's part of each shared batch (the others read the rest), and
    the whole batch once the group is lost."""

    def __init__(self, reader: Reader, exchange: Exchange) -> None:
        self.reader, self.exchange = reader, exchange
        self.name = reader.name
        # Shared batches read in part, each with the ranks (of the first group) that read the others
        self.partial: dict[int, tuple[int, ...]] = {}
        self.on_bytes: Callable[[int], None] = lambda n: None  # counts what `read` brings in (the load's stats)

    def jobs(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> Sequence[Work]:
        if batch.shared and not self.exchange.lost:
            self.partial[batch.index] = self.exchange.members
            return self.reader.jobs(self.exchange.own_part(batch), slot, files)
        return self.reader.jobs(batch, slot, files)

    def read(self, window: Batch, slot: torch.Tensor | None, files: Any) -> None:
        """Blocking: the bytes of `window` (a part of a batch) read into `slot` on this thread."""
        for job in self.reader.jobs(window, slot, files):
            self.on_bytes(job if isinstance(job, int) else job())

    def close(self) -> None:
        self.reader.close()


class CooperativeDevice:
    """A device whose shared batches are first completed by all-gather from the other ranks' parts (or,
    once the group is lost, by reading those parts: `reader`)."""

    def __init__(self, device: Device, exchange: Exchange, reader: CooperativeReader) -> None:
        self.device, self.exchange, self.reader = device, exchange, reader
        self.name, self.staged = device.name, device.staged
        self.buffers = device.buffers + exchange.buffers
        self.padding = exchange.padding  # the last rank's part is rounded up
        self.check: CooperativeCheck | None = None  # verify=: told when a shared batch is whole in its slot

    def new_slot(self, nbytes: int) -> torch.Tensor | None:
        return self.device.new_slot(nbytes)

    def instantiate(self, batch: Batch, slot: torch.Tensor | None, files: Any) -> list[Delivered]:
        then = self.reader.partial.pop(batch.index, None)
        try:
            if batch.shared and slot is not None and then is not None:
                target = slot
                slot = self.exchange.complete(batch, slot, then, lambda window: self.reader.read(window, target, files))
                if self.check is not None and slot is not target:  # gathered on the device: hashed on the host
                    target[: batch.extent].copy_(slot[: batch.extent])
        except BaseException as exc:
            if self.check is not None:
                self.check.completed(batch, exc)
            raise
        if self.check is not None:
            self.check.completed(batch, None)
        return self.device.instantiate(batch, slot, files)

    def close(self) -> None:
        try:
            self.exchange.close()
        finally:
            self.device.close()


class _Whole:
    """Waitable: a shared batch's slot holds every rank's part (or the exchange failed)."""

    def __init__(self, reads: Any) -> None:
        self.reads = reads
        self.event = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.reads.wait()
        self.event.wait()
        if self.error is not None:
            raise self.error


class CooperativeCheck:
    """verify= in a cooperative load: a shared batch is hashed once the exchange has made it whole in
    the slot, so each rank checks every byte it hands out, the parts its peers read included (and
    those read from storage for a lost rank); its own batches are hashed as they are read."""

    def __init__(self, check: Any, device: CooperativeDevice) -> None:
        self.check = check
        self._waiting: dict[int, _Whole] = {}
        self._lock = threading.Lock()
        device.check = self

    def start(self, batch: Batch, slot: torch.Tensor | None, files: Any, reads: Any) -> Any:
        if not (batch.shared and slot is not None):
            return self.check.start(batch, slot, files, reads)
        whole = _Whole(reads)
        with self._lock:
            self._waiting[batch.index] = whole
        return self.check.start(batch, slot, files, whole)

    def completed(self, batch: Batch, error: BaseException | None) -> None:
        with self._lock:
            whole = self._waiting.pop(batch.index, None)
        if whole is not None:
            whole.error = error
            whole.event.set()

    def finish(self, stats: Any, files: Any) -> None:
        self.check.finish(stats, files)

    def close(self) -> None:
        with self._lock:  # hashing threads still waiting for an exchange stop waiting
            waiting, self._waiting = self._waiting, {}
        for whole in waiting.values():
            whole.error = StreamloadError("the load was stopped")
            whole.event.set()
        self.check.close()


def cooperative(reader: Reader, device: Device, exchange: Exchange) -> tuple[Reader, Device]:
    """The reader/device pair of a cooperative load: the pipeline runs it like any other."""
    cooperative_reader = CooperativeReader(reader, exchange)
    return cooperative_reader, CooperativeDevice(device, exchange, cooperative_reader)
