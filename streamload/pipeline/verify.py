"""Integrity: a checkpoint's bytes checked against known digests as they are read, never by reading a
file a second time.

Two kinds of digest:
- whole-file (SHA-256, or MD5): what a Hugging Face cache gives for free (`snapshots/<rev>/<file>` is a
  link to `blobs/<sha256 of the file>`), an S3 object's ETag, a digest file, or `verify={file: hex}`.
  Checking one needs every byte of the file in order, so such a file is read whole, in file order, and
  its verdict comes when its last byte has been hashed.
- per-tensor blocks (a BLAKE3, or an xxh3-64 in format 1, of each `BLOCK_BYTES` of each tensor), from a
  digest file that `streamload digest` writes next to the checkpoint: checked in any order, before a
  tensor is handed out, and for a rank's slice every block it reads whole.

The pipeline hands each batch to `Verifier.start` once its bytes are in (a host slot, or the file's
mapping); the verifier's threads hash it while the consumer makes the batch's tensors, each file's
batches one after another in plan order, files in parallel. A slot is refilled only once its bytes
are hashed; tensors checked by blocks are handed out only once their blocks matched.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from streamload.base import atomic
from streamload.base.errors import IntegrityError, StreamloadError, UnsupportedError
from streamload.base.stats import Stats
from streamload.format.header import FileHeader, TensorInfo
from streamload.integrity.digests import (
    BLOCK_BYTES,
    BLOCK_HASH,
    DIGEST_FILE,
    FORMAT,
    Known,
    block_digest,
    block_hasher,
    entry_of,
    made_from,
    parse,
)
from streamload.pipeline.pipeline import Hashing
from streamload.plan.checkpoint import Checkpoint
from streamload.plan.plan import Batch, Item, Piece, Plan
from streamload.read.base import writable_bytes
from streamload.storage import Digest, Files, is_hex

Verify = bool | Mapping[str, str]
if TYPE_CHECKING:
    from streamload.pipeline.pipeline import Waitable


def known_digests(checkpoint: Checkpoint, strict: bool = True) -> dict[PurePath, Known]:
    """Every file's digests that can be had without reading tensor data: the digest file next to the
    checkpoint, and the storage's own (hub cache blob names, S3 ETags). `strict=False` (for `inspect`):
    a digest file that cannot be read is reported in `stale` instead of raised."""
    sidecars: dict[str, dict[str, Any] | None] = {}
    broken: dict[str, str] = {}
    out: dict[PurePath, Known] = {}
    for header in checkpoint.files:
        folder = str(header.path.parent)
        if folder not in sidecars:
            try:
                raw = checkpoint.storage.sidecar(header.path, DIGEST_FILE)
                sidecars[folder] = None if raw is None else parse(raw, f"{folder}/{DIGEST_FILE}")
            except IntegrityError as exc:
                if strict:
                    raise
                sidecars[folder], broken[folder] = None, str(exc)
        doc = sidecars[folder] or {}
        own = checkpoint.storage.digest(header) if header.prefix else None
        origin = str(PurePath(folder) / DIGEST_FILE)
        entry, stale = entry_of(doc, header.path.name, header.size, origin)
        if entry is None:
            out[header.path] = Known(own, stale=broken.get(folder) or stale)
            continue
        mine = Digest("sha256", entry["sha256"], origin) if isinstance(entry.get("sha256"), str) else None
        out[header.path] = Known(mine or own, entry.get("tensors"), doc["block_bytes"], origin,
                                 header_sha256=entry.get("header_sha256"), block_hash=doc["block_hash"])  # fmt: skip
    return out


def choose(checkpoint: Checkpoint, verify: Verify) -> dict[PurePath, Known]:
    """The digests a load with `verify=` checks each file against (files absent are not checked).
    True: every file's known digests, refusing a file with none; a mapping {file name: hex}: those."""
    if isinstance(verify, Mapping):
        by_name = {h.path.name: h.path for h in checkpoint.files} | {str(h.path): h.path for h in checkpoint.files}
        chosen: dict[PurePath, Known] = {}
        for name, hexdigest in verify.items():
            if name not in by_name:
                raise ValueError(f"verify: {name!r} is not a file of this checkpoint ({', '.join(sorted(by_name))})")
            algorithm = {64: "sha256", 32: "md5"}.get(len(hexdigest))
            if algorithm is None or not is_hex(hexdigest.lower()):
                raise ValueError(f"verify: {name!r}: {hexdigest!r} is not a SHA-256 (64 hex digits) or MD5 (32)")
            chosen[by_name[name]] = Known(Digest(algorithm, hexdigest.lower(), "verify="))
        return chosen
    known = known_digests(checkpoint)
    missing = [str(p) for p, k in known.items() if k.whole is None and k.blocks is None]
    if missing:
        stale = [k.stale for k in known.values() if k.stale]
        raise IntegrityError(
            f"verify=True, but no digest is known for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            f"{' (' + stale[0] + ')' if stale else ''}: write one with `streamload digest "
            f"{checkpoint.files[0].path.parent}`, load from a Hugging Face cache, or pass verify={{file: sha256}}"
        )
    return known


# -- checking --------------------------------------------------------------------------------------


class WholeFile:
    def __init__(self, header: FileHeader, digest: Digest) -> None:
        self.header, self.digest = header, digest
        self.hash = hashlib.new(digest.algorithm)
        self.hash.update(header.prefix)
        self.at = header.data_start
        self.verified = 0

    def feed(self, piece: Piece, data: memoryview, files: Files) -> None:
        if piece.file_offset != self.at:  # a check, not an assert: `python -O` would hash a file out of order
            raise IntegrityError(f"{self.header.path}: bytes fed out of file order: not checked", self.header.path)
        self.hash.update(data)
        self.at += len(data)
        if self.at == self.header.size:
            self._compare()

    def _compare(self) -> None:
        got = self.hash.hexdigest()
        if got != self.digest.hex:
            maybe = (
                " (or the ETag is not an MD5: objects encrypted with SSE-KMS or SSE-C have other ETags; "
                "`streamload digest` writes a digest file to check instead)" if "ETag" in self.digest.origin else ""
            )  # fmt: skip
            raise IntegrityError(
                f"{self.header.path}: the file's {self.digest.algorithm.upper()} is {got}, not {self.digest.hex} "
                f"as {self.digest.origin} says: the file is damaged or was changed{maybe}",
                self.header.path,
            )
        self.verified = self.header.size

    def end(self, files: Files) -> None:
        if self.at != self.header.size:  # (not an assert: kept under `python -O`)
            raise IntegrityError(
                f"{self.header.path}: the stream ended before the file's end: not checked", self.header.path
            )
        if self.header.data_start == self.header.size:  # no tensor bytes: nothing was fed
            self._compare()


class _Open(NamedTuple):
    """A block a slice has hashed part of: its index, where the slice's bytes stop, the hash so far."""

    block: int
    upto: int
    hash: Any
    info: TensorInfo


class Blocks:
    """Per-tensor block digests. A block a rank's slice covers only in part is checked all the same:
    the block's bytes outside the slice are read from the file (a pread, or a ranged GET: at most two
    blocks per slice) and hashed around the slice's own bytes, so every byte handed out is checked,
    and a tensor only once its last block is."""

    def __init__(self, header: FileHeader, known: Known) -> None:
        self.path, self.block = header.path, known.block_bytes
        self.origin, self.hash_name = known.origin, known.block_hash
        self.digests = known.blocks or {}
        self.open: dict[str, _Open] = {}  # tensor -> its block a slice stopped inside
        self.verified = 0

    def feed(self, piece: Piece, data: memoryview, files: Files) -> None:
        info = piece.item.info
        rel = piece.file_offset - info.begin
        pos, end = rel, rel + len(data)
        while pos < end:
            j = pos // self.block
            lo, hi = j * self.block, min((j + 1) * self.block, info.nbytes)
            upto = min(end, hi)
            chunk = data[pos - rel : upto - rel]
            state = self.open.pop(info.name, None)
            if state is not None and not (state.block == j and state.upto == pos):  # a slice's tail, not continued
                self._close(state, files)
                state = None
            if pos == lo and upto == hi:  # a whole block in one piece: the common case
                self._compare(info, j, block_digest(chunk, self.hash_name))
            else:
                if state is not None:  # continued from the last piece
                    h = state.hash
                else:
                    h = block_hasher(self.hash_name)
                    if pos > lo:  # a slice that starts inside a block: the block's head from the file
                        self._hash_file(h, files, info, lo, pos)
                h.update(chunk)
                if upto == hi:
                    self._compare(info, j, h.hexdigest())
                else:
                    self.open[info.name] = _Open(j, upto, h, info)
            pos = upto
        if piece.last and info.name in self.open:  # the tensor's bytes end inside a block: its tail from the file
            self._close(self.open.pop(info.name), files)

    def _close(self, state: _Open, files: Files) -> None:
        hi = min((state.block + 1) * self.block, state.info.nbytes)
        self._hash_file(state.hash, files, state.info, state.upto, hi)
        self._compare(state.info, state.block, state.hash.hexdigest())

    def _hash_file(self, h: Any, files: Files, info: TensorInfo, lo: int, hi: int) -> None:
        for view in files.read(info.path, info.begin + lo, hi - lo):  # type: ignore[arg-type]
            h.update(view)

    def _compare(self, info: TensorInfo, j: int, got: str) -> None:
        want = self.digests[info.name]
        lo, hi = j * self.block, min((j + 1) * self.block, info.nbytes)
        if got != want[j]:
            raise IntegrityError(
                f"{self.path}: tensor {info.name!r}: bytes {lo}..{hi} of it (block {j + 1} of {len(want)}) do not "
                f"match {self.origin}: the file is damaged or was changed",
                self.path,
            )
        self.verified += hi - lo

    def end(self, files: Files) -> None:
        for state in list(self.open.values()):  # slices of a stream stopped early
            self._close(state, files)
        self.open.clear()


# What checks one file: `feed` gets its bytes in plan order (IntegrityError on a mismatch), `end` comes once
# the stream ended, and `verified` counts the bytes that matched.
FileCheck = WholeFile | Blocks


def _check_for(header: FileHeader, known: Known, items: list[Item], in_part: Mapping[PurePath, str]) -> FileCheck:
    if known.blocks is not None:
        if known.header_sha256 is not None and hashlib.sha256(header.prefix).hexdigest() != known.header_sha256:
            raise IntegrityError(
                f"{header.path}: its header (dtypes, shapes, offsets, metadata) differs from the one {known.origin} "
                "was made for: the file is damaged or was changed",
                header.path,
            )
        for item in items:
            blocks = known.blocks.get(item.name)
            count = -(-item.info.nbytes // known.block_bytes)
            if not isinstance(blocks, list) or len(blocks) != count:
                raise IntegrityError(
                    f"{header.path}: tensor {item.name!r}: {known.origin} has no digests of it (or the wrong "
                    "number): it was made for another version of the checkpoint; write it anew with "
                    "`streamload digest`"
                )
        return Blocks(header, known)
    assert known.whole is not None
    what = in_part.get(header.path) or ("its header was not kept" if len(header.prefix) != header.data_start else "")
    if what:
        raise IntegrityError(
            f"{header.path}: only a whole-file digest is known ({known.whole.origin}), and this load does not read "
            f"the whole file ({what}): bytes never read cannot be checked against it. Write per-tensor digests "
            f"with `streamload digest {header.path.parent}` to verify a part of a checkpoint"
        )
    return WholeFile(header, known.whole)


class _Serial:
    """One file's hashing: tasks run one at a time, in the order given, on the verifier's threads."""

    def __init__(self, executor: ThreadPoolExecutor, check: FileCheck) -> None:
        self.executor, self.check = executor, check
        self._queue: deque[tuple[Callable[[], None], Future[None]]] = deque()
        self._lock = threading.Lock()
        self._running = False
        self.closed = False

    def submit(self, task: Callable[[], None]) -> Future[None]:
        done: Future[None] = Future()
        with self._lock:
            self._queue.append((task, done))
            if not self._running:
                self._running = True
                self.executor.submit(self._drain)
        return done

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self.closed:
                    self._running = False
                    return
                task, done = self._queue.popleft()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                task()
                done.set_result(None)
            except BaseException as exc:
                self.closed = True  # a mismatch: this file's later bytes need no hashing
                done.set_exception(exc)

    def cancel(self) -> None:
        with self._lock:
            self.closed = True
            queue, self._queue = self._queue, deque()
        for _, done in queue:
            done.cancel()


class Verifier:
    """Checks the files of a plan against `chosen` digests (see the module's docstring).

    With the mapped reader a tensor is a view of its file's pages, the very bytes a whole-file hash
    reads until the file's end: writing into such a tensor before its file's verdict (`iter`) makes the
    verdict a mismatch (a false alarm, never a false pass). Tensors checked by per-tensor digests are
    hashed before they are handed out."""

    def __init__(self, plan: Plan, chosen: Mapping[PurePath, Known], threads: int | None = None) -> None:
        by_file = plan.items_by_file()
        in_part = plan.read_in_part()
        checks = {
            p: _check_for(plan.files[p], chosen[p], items, in_part) for p, items in by_file.items() if p in chosen
        }
        self._executor = ThreadPoolExecutor(threads or min(4, os.cpu_count() or 1), "streamload-verify")
        self._files = {p: _Serial(self._executor, c) for p, c in checks.items()}

    def start(self, batch: Batch, slot: torch.Tensor | None, files: Any, reads: Waitable) -> Hashing:
        """Queue the hashing of `batch` (called in plan order, as its reads are handed out): each of its
        files' parts waits for `reads` on a verifier thread, then is hashed, while the consumer is
        still on earlier batches."""
        if slot is not None and not slot.is_cpu:
            raise UnsupportedError("verify hashes bytes in host memory: this reader put them on the device")
        view = writable_bytes(slot) if slot is not None else None
        pieces: dict[PurePath, list[Piece]] = {}
        for p in batch.pieces:
            if p.item.info.path in self._files and p.length:
                pieces.setdefault(p.item.info.path, []).append(p)
        futures, before = [], False
        for path, mine in pieces.items():
            serial = self._files[path]
            if view is None:  # the mapped reader: the bytes are the file's own pages
                source = writable_bytes(torch.empty(0, dtype=torch.uint8).set_(files.mapping(path)))
            else:
                source = view

            def task(check: FileCheck = serial.check, mine: list[Piece] = mine, source: memoryview = source) -> None:
                reads.wait()  # a read error is the consumer's to raise; here it only stops the hashing
                for p in mine:
                    at = p.file_offset if view is None else p.slot_offset
                    check.feed(p, source[at : at + p.length], files)

            futures.append(serial.submit(task))
            # Per-tensor digests: a tensor is handed out only once hashed. A whole file's verdict comes at
            # its end; waiting for each batch's hash there was measured 1.57x cold against 1.15x (mapped
            # reader). Mapped tensors share their pages with what is hashed: see `Verifier`'s note.
            before = before or isinstance(serial.check, Blocks)
        return Hashing(futures, before)

    def finish(self, stats: Stats, files: Files) -> None:
        """The stream ended (every batch hashed): count what was checked."""
        for serial in self._files.values():
            serial.check.end(files)
            stats.bytes_verified += serial.check.verified

    def close(self) -> None:
        """Stop hashing; returns once no thread reads a slot any more (slots may be released then)."""
        for serial in self._files.values():
            serial.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)


# -- writing a digest file -------------------------------------------------------------------------

_READ_BYTES = 16 << 20


def write_digests(checkpoint: Checkpoint, out: PurePath | None = None) -> tuple[PurePath, dict[str, Any]]:
    """Hash every file of a checkpoint (format 2: BLAKE3 of each block of each tensor, the file's SHA-256 and
    MD5, its header's SHA-256, and the version of the file it was read at; files in parallel, each read once,
    in order) and write `streamload.digests.json` next to local files, or to `out` (where a remote
    checkpoint's digest file is written, to be published beside its objects). Returns the path and the doc."""
    folders = {h.path.parent for h in checkpoint.files}
    if len(folders) > 1:
        raise UnsupportedError(f"the checkpoint's files are in {len(folders)} folders: a digest file covers one")
    if out is None and not checkpoint.storage.local:
        raise UnsupportedError(
            "streamload digest of a remote checkpoint writes the digest file locally: name where (--out FILE), "
            f"then publish it beside the objects as {DIGEST_FILE}"
        )
    target = out if out is not None else next(iter(folders)) / DIGEST_FILE
    folder = PurePath(target).parent
    if not os.access(folder, os.W_OK):  # before hashing every byte (read-only mounts refuse root too)
        raise _unwritable(folder, "not writable")
    headers = {h.path: h for h in checkpoint.files}
    files = checkpoint.storage.open(headers)
    try:
        with ThreadPoolExecutor(min(len(headers), os.cpu_count() or 1)) as pool:
            entries = list(pool.map(lambda h: _digest_of(h, files), checkpoint.files))
    finally:
        files.close()
    doc = {"format": FORMAT, "block_bytes": BLOCK_BYTES, "block_hash": BLOCK_HASH,
           "files": {h.path.name: e for h, e in zip(checkpoint.files, entries, strict=True)}}  # fmt: skip
    try:
        atomic.write(Path(target), json.dumps(doc, indent=1).encode())
    except OSError as exc:  # a read-only folder, a full disk: name the folder, not the temporary file
        raise _unwritable(folder, exc.strerror or str(exc)) from None
    return target, doc


def _unwritable(folder: PurePath, why: str) -> StreamloadError:
    return StreamloadError(
        f"{folder}: cannot write {DIGEST_FILE} there ({why}): loads look for it next to the files, so copy "
        "the checkpoint to a writable folder and run `streamload digest` on the copy"
    )


def _digest_of(header: FileHeader, files: Files) -> dict[str, Any]:
    whole, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)  # MD5: what an S3 ETag names, to bind to it
    blocks: dict[str, list[str]] = {t.name: [] for t in header.tensors}
    tensors = iter(header.tensors)
    current = next(tensors, None)
    block = block_hasher()
    offset = 0
    while offset < header.size:
        for data in files.read(header.path, offset, min(_READ_BYTES, header.size - offset)):
            n = len(data)
            if n == 0:
                raise IntegrityError(f"{header.path}: ended at {offset} bytes, its header says {header.size}")
            whole.update(data)
            md5.update(data)
            at = max(offset, header.data_start)
            while current is not None and at < offset + n:  # the tensors' blocks in this read
                if current.nbytes == 0:
                    current = next(tensors, None)
                    continue
                rel = at - current.begin
                upto = min(offset + n, current.end, current.begin + (rel // BLOCK_BYTES + 1) * BLOCK_BYTES)
                block.update(data[at - offset : upto - offset])
                at = upto
                if (upto - current.begin) % BLOCK_BYTES == 0 or upto == current.end:
                    blocks[current.name].append(block.hexdigest())
                    block.reset()
                if upto == current.end:
                    current = next(tensors, None)
            offset += n
    head = hashlib.sha256(header.prefix).hexdigest()
    return {"size": header.size, "sha256": whole.hexdigest(), "md5": md5.hexdigest(), "header_sha256": head,
            "origin": made_from(header), "tensors": blocks}  # fmt: skip
