"""Hugging Face hub ids: `"org/name"` or `"name"`, either with `@revision`, or `hf://org/name@revision`.

Loaded as transformers loads them: from the local hub cache (huggingface_hub's layout: `HF_HUB_CACHE`, else
`HF_HOME/hub`) where the snapshot holds every weight file, with no request; else from the hub (`HF_ENDPOINT`, the
token of huggingface_hub's `get_token`), into that cache while the load reads it:
- the index (and any small file asked for beside the weights) by huggingface_hub's `hf_hub_download`;
- each weight file by a thread of its own (huggingface_hub's `http_get`, from where the resolve URL redirects)
  into `blobs/<etag>.incomplete`, which grows in file order: a read waits for its bytes there, so the load goes
  on while the files download; a partial file is kept when a download fails or the process dies, and the next
  load resumes at its end;
- checked as it is written: hashed in order (`integrity.whole`) and compared with the etag (an LFS file's SHA-256,
  a git blob's SHA-1) before it is renamed to `blobs/<etag>` and linked from the snapshot; a mismatch removes it,
  the part a resumed download kept included;
- handed out only as its verdict allows: the range holding a file's last byte only once the file has passed, and
  nothing of a file that failed; a load ends only once every file it read from has passed
  (`HubFiles.verdict_at_end`), and a load with `verify=` reads nothing of a file before its verdict;
- one writer per blob: the lock file huggingface_hub's own downloads take (`.locks/models--org--name/<etag>.lock`).
`HF_HUB_OFFLINE=1`: the cache only. What the hub answers chooses no path: an etag and a commit must be hex digests,
and shard names plain (`base.parse_index`). A string is a hub id only where no local path has its name.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePath
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from streamload.base import settings
from streamload.base.errors import IntegrityError, MissingFileError, ReadError, SourceError, UnsupportedError
from streamload.format.header import FIRST_READ, FileHeader, FileVersion, header_from
from streamload.integrity.digests import Digest
from streamload.integrity.whole import WholeFile, WholeFileMismatch
from streamload.storage.base import INDEX_NAME, Copied, Listing, Partly, Source, first_line, is_hex, parse_index
from streamload.storage.local import LocalFiles, LocalStorage, pread_full

SINGLE_NAME = "model.safetensors"
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?"  # a hub user, org or repo name
_HUB_ID = re.compile(rf"(?:hf://)?(?P<repo>(?:{_NAME}/)?{_NAME})(?:@(?P<revision>[A-Za-z0-9._/-]+))?")
_FILE_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth")  # a missing file's name, not a repo's


class HubId(NamedTuple):
    repo: str
    revision: str


def hub_id(source: object) -> HubId | None:
    """`source` as a hub id, or None: `hf://...`, or a string with a hub id's shape that names nothing local."""
    if not isinstance(source, str):
        return None
    found = _HUB_ID.fullmatch(source)  # no other scheme (no ":" in a name)
    if found is None or ".." in source or found["repo"].endswith(_FILE_SUFFIXES):
        return None
    if not source.startswith("hf://") and os.path.lexists(source):
        return None
    revision = found["revision"] or "main"
    if any(part in ("", ".", "..") for part in revision.split("/")):
        return None
    return HubId(found["repo"], revision)


def cache_root() -> Path:
    """The hub cache, as huggingface_hub finds it (read now, so a variable set after its import counts)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(_hf().constants.HF_HUB_CACHE)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or _hf().constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    said = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return settings.switched_on(said) or bool(_hf().constants.HF_HUB_OFFLINE)


def _hf() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
        import huggingface_hub.utils
    except ImportError:
        raise UnsupportedError(
            "loading a Hugging Face hub id needs huggingface_hub: pip install huggingface_hub"
        ) from None
    return huggingface_hub


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


class Remote(NamedTuple):
    """What the hub says of one file at one commit."""

    name: str
    url: str  # where its bytes are: the resolve URL, or the CDN it redirects to
    etag: str  # an LFS file's SHA-256, else its git blob's SHA-1
    size: int
    commit: str
    headers: dict[str, str]


class HubStorage:
    """One hub repo at one revision: the snapshot's files in the local cache, and those downloading into it."""

    local = False  # read through `HubFiles.read` (the range reader): a file may still be arriving

    @property
    def first_batch(self) -> int:
        """A first tensor as soon as its own bytes are in, as for objects."""
        from streamload.storage.pace import SMALLEST  # (pace imports statistics: only a load of a hub id needs it)

        return SMALLEST

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache = Path(cache_dir) if cache_dir is not None else cache_root()
        self.id: HubId | None = None
        self.commit: str | None = None
        self.downloads: dict[PurePath, Download] = {}
        self.held = False  # a verified load's: no byte of a download before its file's verdict

    def held_until_checked(self) -> HubStorage:
        """This storage for a load that must hand out nothing unchecked (`verify=`): its downloads' bytes are
        read only once their file has passed its SHA-256 (the downloads themselves are shared)."""
        held = copy.copy(self)
        held.held = True
        return held

    # -- listing and headers ------------------------------------------------------------------------
    def locate(self, source: Source) -> Listing:
        found = hub_id(source)
        if found is None:
            raise SourceError(f"{source}: not a Hugging Face hub id (org/name, name, with @revision)")
        self.id = found
        local = self._cached()
        if local is not None:
            return local
        if offline():
            raise MissingFileError(
                f"{found.repo}: not in the Hugging Face cache ({self.cache}) at {found.revision}, and HF_HUB_OFFLINE "
                f"is set: nothing is downloaded (run once online, or `hf download {found.repo}`); no local path "
                f"{source!r} either"
            )
        return self._fetch(found)

    def _cached(self) -> Listing | None:
        """The snapshot's weight files, where the cache holds every one of them (no request made)."""
        index = self._cached_file(INDEX_NAME)
        if index is not None:
            try:
                listing = parse_index(index, index.read_text("utf-8"))
            except (OSError, ValueError):
                return None
            if not all(Path(p).is_file() for p in listing.files):
                return None
            _refuse_theirs(self.id.repo, [index, *map(Path, listing.files)])
            self.commit = index.parent.name
            return LocalStorage().locate(index)  # its checks: shards inside the snapshot or its blobs
        single = self._cached_file(SINGLE_NAME)
        if single is None:
            return None
        _refuse_theirs(self.id.repo, [single])
        self.commit = single.parent.name
        return Listing([single])

    def _cached_file(self, name: str, revision: str | None = None) -> Path | None:
        assert self.id is not None
        found = _hf().try_to_load_from_cache(
            self.id.repo, name, cache_dir=str(self.cache), revision=revision or self.id.revision
        )
        return Path(found) if isinstance(found, str) and os.path.isfile(found) else None

    def _fetch(self, found: HubId) -> Listing:
        """The index by `hf_hub_download`, then each weight file: from the cache, or downloading into it."""
        hf = _hf()
        try:
            index: Path | None = Path(self._download_small(INDEX_NAME, found.revision))
        except hf.errors.EntryNotFoundError:
            index = None
        names = [SINGLE_NAME]
        listing = Listing([])
        if index is not None:
            listing = parse_index(index, index.read_text("utf-8"))
            names = [p.name for p in listing.files]
            self.commit = _commit(index.parent.name, found.repo)
        at = self.commit or found.revision
        with ThreadPoolExecutor(min(8, len(names))) as pool:  # one HEAD request a file, all at once
            remotes = list(pool.map(lambda n: self._remote(n, at), names))
        self.commit = remotes[0].commit
        if index is None:
            _write_ref(repo_folder(self.cache, found.repo), found.revision, self.commit)
        snapshot = self.snapshot
        files: list[PurePath] = []
        for remote in remotes:
            link = snapshot / remote.name
            if not link.is_file():
                self.downloads[link] = Download(self.cache, found, remote, link)
            files.append(link)
        return listing._replace(files=files)

    @property
    def snapshot(self) -> Path:
        assert self.id is not None and self.commit is not None
        return repo_folder(self.cache, self.id.repo) / "snapshots" / self.commit

    def _download_small(self, name: str, revision: str) -> str:
        """A small file, by huggingface_hub into the cache; hub errors named by the repo id."""
        hf = _hf()
        assert self.id is not None
        try:
            return str(hf.hf_hub_download(self.id.repo, name, revision=revision, cache_dir=str(self.cache),
                                          endpoint=endpoint()))  # fmt: skip
        except hf.errors.EntryNotFoundError:
            raise
        except Exception as exc:
            raise _named(self.id, exc) from None

    def _remote(self, name: str, revision: str) -> Remote:
        """Where the bytes of `name` are, their etag, size and commit: one HEAD request (huggingface_hub's)."""
        hf = _hf()
        assert self.id is not None
        url = hf.hf_hub_url(self.id.repo, name, revision=revision, endpoint=endpoint())
        try:
            meta = hf.get_hf_file_metadata(url, endpoint=endpoint())
        except Exception as exc:
            raise _named(self.id, exc, name) from None
        etag, commit, size = meta.etag or "", meta.commit_hash or "", meta.size
        if size is None or not (len(etag) in (40, 64) and is_hex(etag)):  # an LFS file's SHA-256, a git blob id
            raise SourceError(f"{self.id.repo}: {name}: the hub gave no usable etag ({etag!r}) or size ({size!r})")
        headers = dict(hf.utils.build_hf_headers())
        location = meta.location or url
        if urlsplit(location).netloc != urlsplit(url).netloc:  # a CDN's URL is signed: no token goes there
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        return Remote(name, location, etag, int(size), _commit(commit, self.id.repo), headers)

    def header(self, path: PurePath) -> FileHeader:
        download = self.downloads.get(path)
        if download is None:
            return LocalStorage().header(path)
        never = threading.Event()
        head = download.read(0, min(download.size, FIRST_READ), never)
        header = header_from(path, download.size, bytes(head), lambda at, n: bytes(download.read(at, n, never)))
        return header._replace(identity=FileVersion(download.size, content=download.etag))

    def open(self, headers: dict[PurePath, FileHeader], partly: Partly = None) -> HubFiles:
        return HubFiles(self, headers, self.held)

    def cached(self, headers: tuple[FileHeader, ...]) -> Copied | None:
        """The snapshot's files, once none is still downloading (a load then reads them as local files)."""
        if any(not self.downloads[h.path].complete() for h in headers if h.path in self.downloads):
            return None
        return Copied([Path(h.path) for h in headers], {})  # this user's own (`_refuse_theirs`), or just checked

    def digest(self, header: FileHeader) -> Digest | None:
        download = self.downloads.get(header.path)
        if download is None:
            return LocalStorage().digest(header)
        if len(download.etag) == 64:
            return Digest("sha256", download.etag, f"the hub's LFS SHA-256 of {download.remote.name}")
        return None

    def sidecar(self, near: PurePath, name: str) -> bytes | None:
        """`name` beside `near` in the snapshot: from the cache, else (online) by `hf_hub_download`."""
        try:
            folder = Path(near).parent.relative_to(self.snapshot)
        except ValueError:
            return LocalStorage().sidecar(near, name)
        relative = (folder / name).as_posix()
        local = self._cached_file(relative, self.commit)
        if local is None and not offline():
            try:
                local = Path(self._download_small(relative, self.commit or "main"))
            except _hf().errors.EntryNotFoundError:
                return None
        return None if local is None else local.read_bytes()

    def wait(self) -> None:
        """Every download complete (raises the first that failed)."""
        for download in self.downloads.values():
            download.settled(threading.Event())


class HubFiles:
    """The files of one load: local ones read as local files, those downloading as their bytes arrive."""

    def __init__(self, storage: HubStorage, headers: dict[PurePath, FileHeader], held: bool = False) -> None:
        self._downloads = storage.downloads
        self._local = LocalFiles({p: h for p, h in headers.items() if p not in storage.downloads})
        self._stopped = threading.Event()
        self._held = held
        self._read: set[PurePath] = set()  # the downloads this load read from: `verdict_at_end` waits for them

    def read(self, path: PurePath, offset: int, length: int) -> list[memoryview]:
        download = self._downloads.get(path)
        if download is None:
            return self._local.read(path, offset, length)
        self._read.add(path)
        return [download.read(offset, length, self._stopped, self._held)]

    def verdict_at_end(self) -> None:
        """At a stream's end (the pipeline's call): the load ends only once every file it read from has passed its
        SHA-256 (a load of part of a file included); else the file's IntegrityError (or why it did not download)."""
        for path in sorted(self._read):
            self._downloads[path].settled(self._stopped)

    def cancel(self) -> None:
        self._stopped.set()  # the downloads go on: the next load finds their files complete

    def close(self) -> None:
        self.cancel()
        self._local.close()


class Download:
    """One weight file downloading into the hub cache on a thread of its own (see the module's docstring)."""

    def __init__(self, cache: Path, found: HubId, remote: Remote, link: Path) -> None:
        self.remote, self.link, self.repo = remote, link, found.repo
        self.etag, self.size = remote.etag, remote.size
        self.what = f"{found.repo}@{found.revision}: {remote.name}"  # how an error names the file
        folder = repo_folder(cache, found.repo)
        self.blob = folder / "blobs" / remote.etag
        self.partial = Path(f"{self.blob}.incomplete")
        self.lock = cache / ".locks" / folder.name / f"{remote.etag}.lock"
        self._have = 0  # bytes of the file in order on disk
        self._fd: int | None = None  # read-only, on the partial file (the same inode once it is the blob)
        self._error: BaseException | None = None
        self._finished = False
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name=f"streamload-hub {remote.name}", daemon=True).start()

    def complete(self) -> bool:
        with self._changed:
            return self._finished and self._error is None

    def settled(self, stopped: threading.Event) -> None:
        """The download ended and its file passed; else why not (IntegrityError: its SHA-256 failed), or a
        ReadError once `stopped` is set."""
        with self._changed:
            while not self._finished and not stopped.is_set():
                self._changed.wait(0.25)
            if not self._finished:
                raise ReadError(f"{self.link}: the stream was closed while the file downloaded")
        if self._error is not None:
            raise self._refusal()

    def read(self, offset: int, length: int, stopped: threading.Event, held: bool = False) -> memoryview:
        """`length` bytes at `offset`, once the download has them; the file's last byte (or with `held`, any
        byte) only once the whole file has passed its SHA-256; nothing of a file that failed it."""
        end = offset + length
        verdict = held or end >= self.size  # what is read waits for the file's verdict
        with self._changed:
            while (verdict or self._have < end) and not self._finished and not stopped.is_set():
                self._changed.wait(0.25)
            if stopped.is_set():
                raise ReadError(f"{self.link}: the stream was closed while the file downloaded")
            if isinstance(self._error, IntegrityError) or (verdict and self._error is not None):
                raise self._refusal()
            if self._have < end or self._fd is None:
                raise ReadError(self._failure())
            fd = self._fd
        out = pread_full(fd, length, offset)
        if len(out) < length:
            raise ReadError(f"{self.link}: its downloaded bytes end at {offset + len(out)} (removed meanwhile?)")
        return out

    def _refusal(self) -> IntegrityError | ReadError:
        """The download's error as a load raises it (one of its own per reader: each may add to it)."""
        if isinstance(self._error, IntegrityError):
            return WholeFileMismatch(str(self._error.args[0]), self.link)
        return ReadError(self._failure())

    def _failure(self) -> str:
        return (
            f"{self.repo}: {self.remote.name}: the download failed at {self._have} of {self.size} bytes "
            f"({first_line(self._error)}); the next load resumes from {self.partial}"
        )

    # -- the download thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.lock.parent.mkdir(parents=True, exist_ok=True)
            self.blob.parent.mkdir(parents=True, exist_ok=True)
            with _hf().utils.WeakFileLock(str(self.lock)):  # one writer per blob, huggingface_hub's downloads too
                if self.blob.is_file():
                    _refuse_theirs(self.repo, [self.blob])
                    self._opened(self.blob, self.size)
                else:
                    self._fetch()
                _link(self.blob, self.link)
        except BaseException as exc:  # told to the readers, which raise it named
            self._error = exc
        finally:
            with self._changed:
                self._finished = True
                self._changed.notify_all()

    def _opened(self, path: Path, have: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        weakref.finalize(self, os.close, fd)
        with self._changed:
            self._fd, self._have = fd, have
            self._changed.notify_all()

    def _fetch(self) -> None:
        hf = _hf()
        fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        with open(fd, "r+b", buffering=0) as f:
            have = f.seek(0, os.SEEK_END)
            if have > self.size:  # not this file's beginning: start again
                f.truncate(0)
                have = f.seek(0)
            sink = _Sink(self, f, self._whole())
            sink.rehash(have)
            self._opened(self.partial, have)
            hf.file_download.http_get(self.remote.url, sink, resume_size=have, headers=self.remote.headers,
                                      expected_size=self.size, displayed_filename=self.remote.name)  # fmt: skip
        try:
            sink.whole.verdict()
        except WholeFileMismatch as exc:
            # Removed whole, a resumed download's kept part with it: a bad byte may be anywhere in it (a tail
            # a crash left zeroed), so the next load starts again from the file's first byte.
            self.partial.unlink(missing_ok=True)
            resumed = f"; the download had resumed after {have} bytes an earlier one left" if have else ""
            raise WholeFileMismatch(
                f"{exc.args[0]}{resumed}; removed from the hub cache (the next load downloads it anew)", self.link
            ) from None
        os.replace(self.partial, self.blob)  # the same inode: reads in flight go on

    def _whole(self) -> WholeFile:
        """The check of this file's bytes against what the hub says of it (its etag)."""
        origin = f"commit {self.remote.commit}"
        if len(self.etag) == 64:  # an LFS file: its SHA-256 (the X-Linked-Etag)
            return WholeFile("sha256", self.etag, self.what, origin=f"the hub (X-Linked-Etag, {origin})",
                             path=self.link)  # fmt: skip
        return WholeFile("sha1", self.etag, self.what, origin=f"the hub (its git blob id, {origin})",
                         prefix=b"blob %d\0" % self.size, path=self.link)  # fmt: skip

    def _arrived(self, have: int) -> None:
        with self._changed:
            self._have = have
            self._changed.notify_all()


class _Sink:
    """The file object `http_get` writes into: each chunk hashed in order and told to the readers."""

    def __init__(self, download: Download, f: Any, whole: WholeFile) -> None:
        self._download, self._f, self.whole = download, f, whole

    def rehash(self, have: int) -> None:
        """The hash of the first `have` bytes already in the file (a download resumed)."""
        self.whole.reset()
        at = 0
        while at < have:
            chunk = os.pread(self._f.fileno(), min(16 << 20, have - at), at)
            if not chunk:
                raise ReadError(f"{self._download.partial}: ends at {at}, not {have}")
            self.whole.update(chunk)
            at += len(chunk)

    def write(self, chunk: bytes) -> int:
        view = memoryview(chunk)
        while view:
            view = view[self._f.write(view) :]
        self.whole.update(chunk)
        self._download._arrived(self._f.tell())
        return len(chunk)

    def tell(self) -> int:
        return int(self._f.tell())

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return int(self._f.seek(offset, whence))

    def truncate(self, size: int | None = None) -> int:
        """A server that ignored the resume's `Range` sends the whole file: it starts again from 0."""
        end = int(self._f.truncate(size))
        self.rehash(end)
        self._download._arrived(end)
        return end


def _refuse_theirs(repo: object, paths: list[Path]) -> None:
    """A hub cache is read as its owner's: a snapshot link or blob another user wrote could name any bytes by
    any SHA-256 (a blob's name is what checks it), so it is refused, naming it (not hashed against itself)."""
    for path in paths:
        try:
            theirs = os.lstat(path).st_uid != os.geteuid() or os.stat(path).st_uid != os.geteuid()
        except OSError:
            continue  # gone meanwhile: the load's own reads say so
        if theirs:
            shown = f"{path} (-> {os.path.realpath(path)})" if os.path.islink(path) else str(path)
            raise SourceError(
                f"{repo}: {shown} in the Hugging Face cache was written by another user: a hub cache is read only "
                "as its owner's (its blobs are named by the digests that check them): use a cache of your own "
                "(HF_HUB_CACHE)"
            )


def _commit(text: str, repo: str) -> str:
    if len(text) != 40 or not is_hex(text):
        raise SourceError(f"{repo}: the hub gave no commit hash ({text!r})")
    return text


def _write_ref(folder: Path, revision: str, commit: str) -> None:
    """`refs/<revision>` naming `commit`, as huggingface_hub writes it (a commit hash needs none)."""
    if revision == commit:
        return
    ref = folder / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    temporary = ref.with_name(f".{ref.name}.{os.getpid()}")
    temporary.write_text(commit)
    os.replace(temporary, ref)


def _link(blob: Path, link: Path) -> None:
    """`snapshots/<commit>/<file>` linked to its blob, relatively, as huggingface_hub links it."""
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.symlink(os.path.relpath(blob, link.parent), link)


def _named(found: HubId, exc: BaseException, name: str | None = None) -> BaseException:
    """A huggingface_hub error as one line naming the repo id (and what to do)."""
    errors = _hf().errors
    what = f"{found.repo}" + (f": {name}" if name else "")
    if isinstance(exc, errors.GatedRepoError):
        return SourceError(f"{what}: a gated repo on {endpoint()}: accept its terms there, then log in "
                           "(`hf auth login`) or set HF_TOKEN")  # fmt: skip
    if isinstance(exc, errors.RepositoryNotFoundError):
        return MissingFileError(f"{what}: no such local path, and no such repo on {endpoint()} (or it is private: "
                                "log in with `hf auth login` or set HF_TOKEN)")  # fmt: skip
    if isinstance(exc, errors.RevisionNotFoundError):
        return MissingFileError(f"{what}: no revision {found.revision!r} on {endpoint()}")
    if isinstance(exc, errors.EntryNotFoundError):
        return MissingFileError(f"{what}: neither {INDEX_NAME} nor {SINGLE_NAME} is in the repo")
    return ReadError(f"{what}: no such local path, not in the Hugging Face cache, and {endpoint()} could not be "
                     f"asked: {first_line(exc)}")  # fmt: skip


def snapshot_folder(source: str, cache_dir: Path | None = None) -> Path:
    """The snapshot folder of a hub id with its weights and config.json complete (downloaded where the
    cache lacks them): what `from_pretrained` builds a model from."""
    storage = HubStorage(cache_dir)
    storage.locate(source)
    storage.wait()
    if not (storage.snapshot / "config.json").is_file() and not (storage.snapshot / "model_index.json").is_file():
        storage.sidecar(storage.snapshot / "config.json", "config.json")
    return storage.snapshot
