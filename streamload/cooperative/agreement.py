"""The ranks of a cooperative load agree on the plan, and that they read the same bytes.

The ranks' plans agree on names, dtypes, shapes and offsets; each file must also be the same bytes on
every rank. A file's version, as the storage names it without reading data, settles most cases at no
cost: one file on one host (its host's identity, device, inode, size and mtime), one file on a network
file system every host mounts (the file system's type, source and server, inode, size and mtime), or one
URL, size and ETag (one object version). A local version names its host: hosts made from one image have
files of equal device, inode, size and mtime that need not hold equal bytes (see `_host_identity`,
`_network_mounts`). Where ranks name different versions (a copy on each host's own disk, another URL),
the versions prove nothing either way: the ranks compare what they read of each file (its size, header,
the first and last 64 KiB of its data and 4 KiB at 6 points between) and the digests known of it
(`streamload.digests.json`, a hub cache's blob name, an S3 MD5 ETag). Identical copies agree and load
together; a file whose sampled bytes differ, or whose digests of one kind differ, is refused, naming each
rank's file: ranks mixing two versions hand out tensors of neither. A change that leaves every sampled
byte alone is told only by digests (written by `streamload digest`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Sequence
from typing import Any

import torch

from streamload.base.errors import StreamloadError
from streamload.cooperative.group import Group, Left
from streamload.cooperative.lost_rank import regroup
from streamload.format.header import FileHeader, FileVersion
from streamload.pipeline.verify import known_digests
from streamload.plan.checkpoint import Checkpoint
from streamload.plan.plan import Item

ENDS = 64 << 10  # bytes of a file's data sampled at each end
PROBES, PROBE = 6, 4 << 10  # and blocks of this size between them


def agree(group: Group, checkpoint: Checkpoint, candidates: Sequence[Item], layout: str) -> set[str]:
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
    group.load_key = f"{group.number}-{digest.hexdigest()[:16]}"
    agreed = None
    while agreed is None:
        try:
            agreed = _agree(group, checkpoint, names, digest.digest(), candidates)
        except Left as exc:
            regroup(group, StreamloadError(f"cooperative loading: agreeing on the plan: {exc}"))
            if group.lost:  # alone: every tensor this rank reads, it reads whole itself
                agreed = {i.name for i in candidates}
    group.steps += 1
    return agreed


def _agree(
    group: Group, checkpoint: Checkpoint, names: list[str], digest: bytes, candidates: Sequence[Item]
) -> set[str]:
    try:
        digests = group.gather_small(torch.frombuffer(bytearray(digest), dtype=torch.uint8))
        others = [group.members[r] for r, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if others:
            raise StreamloadError(
                f"cooperative loading: ranks {others} load a different checkpoint (or ring layout: "
                f"slot size, order) than rank {group.members[0]}; every rank of the group must call iter() alike"
            )
        _same_files(group, checkpoint)
        wanted = {i.name for i in candidates}
        mask = torch.tensor([n in wanted for n in names], dtype=torch.uint8)
        everyone = group.gather_small(mask).min(dim=0).values
    except (StreamloadError, Left):
        raise
    except Exception as exc:
        raise StreamloadError(
            f"cooperative loading: rank {group.rank} of {group.world}: agreeing on the plan with the "
            f"other ranks failed (every rank must call iter() with cooperative loading): {exc}"
        ) from exc
    return {n for n, keep in zip(names, everyone.tolist(), strict=True) if keep}


def _same_files(group: Group, checkpoint: Checkpoint) -> None:
    """Collective: refuses files that are not the same bytes on every rank: the plan says which bytes
    of which file name each rank reads, not which file."""
    files = sorted(checkpoint.files, key=lambda h: h.path.name)
    mounts = _network_mounts() if checkpoint.storage.local else {}
    named = b"".join(version(h, checkpoint, mounts) for h in files)
    every = group.gather_small(torch.frombuffer(bytearray(named), dtype=torch.uint8)).view(group.world, len(files), -1)
    unsure = [i for i in range(len(files)) if not bool((every[:, i] == every[0, i]).all())]
    if not unsure:
        return  # one file (a shared file system), or one object version, for every rank
    headers = [files[i] for i in unsure]
    claims, prints = known_claims(checkpoint, headers), fingerprints(checkpoint, headers)
    mine = b"".join(c + f for c, f in zip(claims, prints, strict=True))
    every = group.gather_small(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    every = every.view(group.world, len(unsure), 2, -1)
    different = {k: why for k in range(len(unsure)) if (why := differ(every[:, k]))}
    if different:
        raise StreamloadError(_different(group, headers, different, every))


def _different(group: Group, headers: list[FileHeader], different: dict[int, str], every: torch.Tensor) -> str:
    """Collective: the refusal of the files that differ, naming each rank's file."""
    paths = [text.split("\n") for text in _gather_text(group, "\n".join(str(headers[k].path) for k in different))]
    said = []
    for j, (k, why) in enumerate(different.items()):
        groups: dict[bytes, list[int]] = {}
        for r in range(group.world):
            groups.setdefault(bytes(every[r, k].flatten().tolist()), []).append(r)
        ranks = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(str(group.members[r]) for r in rs)}: "
            f"{', '.join(sorted({paths[r][j] for r in rs}))}"
            for rs in groups.values()
        )
        said.append(f"{headers[k].path.name} ({why}): {ranks}")
    return (
        f"cooperative loading: the ranks were given different files (or versions) of the same layout: "
        f"{' | '.join(said)}; every rank must load the same bytes (identical copies elsewhere are fine), "
        f"or load without cooperative="
    )


def _gather_text(group: Group, text: str) -> list[str]:
    """Collective: every rank's `text`."""
    raw = text.encode()
    longest = int(group.gather_small(torch.tensor([len(raw)], dtype=torch.int64)).max())
    rows = group.gather_small(torch.frombuffer(bytearray(raw.ljust(max(1, longest), b"\0")), dtype=torch.uint8))
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]


def version(header: FileHeader, checkpoint: Checkpoint, mounts: dict[int, tuple[str, ...]]) -> bytes:
    """32 bytes naming the version of a file as its storage identifies it, without reading data:
    equal on two ranks means the same bytes; different proves nothing (copies). `mounts`: this host's
    network file systems (`_network_mounts`)."""
    if checkpoint.storage.local:
        named = _local_version(header.identity, mounts)
    else:  # an ETag names a version of one URL's object (a server on the loopback is each host's own)
        named = (str(header.path), header.identity, *_loopback_host(str(header.path)))
    return hashlib.sha256(repr((header.size, named)).encode()).digest()


def _local_version(identity: FileVersion | None, mounts: dict[int, tuple[str, ...]]) -> tuple[object, ...]:
    """A local file's version: on a network file system, its server's inode number, size and mtime
    (the same on every host that mounts it; the device number is each host's own); else its host's
    identity with its device, inode, size and mtime. Without an identity, one no other rank names."""
    if identity is None or identity.device is None:
        return ("unknown", secrets.token_hex(16))
    device, inode, size, mtime = identity.device, identity.inode, identity.size, identity.mtime_ns
    if device in mounts:
        return ("shared", *mounts[device], inode, size, mtime)
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
    known = known_digests(checkpoint, strict=False)
    out = [bytes(32)] * len(headers)
    for i, h in enumerate(headers):
        whole = known[h.path].whole if h.path in known else None
        if whole is not None:
            out[i] = (
                hashlib.sha256(whole.algorithm.encode()).digest()[:8] + hashlib.sha256(whole.hex.encode()).digest()[:24]
            )
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
