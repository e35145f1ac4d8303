"""Objects: S3 and S3-compatible stores, Google Cloud Storage, Azure Blob, and HTTP(S) servers that honour `Range`.

Every read is a ranged GET made by obstore (Rust's `object_store`: async requests that release the GIL and can be
dropped mid-flight), on one event loop thread per process; readers block on them from their own threads, so a
load's concurrency is its reader threads, as for local files. A process forked after it made requests has neither
that thread nor obstore's runtime: it starts its own of both (`_forked`, `_native`). Each URL scheme is one row of
`PROFILES`: its obstore store, whether it lists, which of its SDK's environment variables give credentials and
endpoint (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, `GOOGLE_APPLICATION_CREDENTIALS`, ...), what its messages say.

Versions. A tensor is handed out as soon as its own bytes are in, so a change to an object mid-load must be seen on
the response that brings the changed bytes: a check at the end of a load could not take back the tensors already
handed out. Each object's size and validator are taken with its header, and every later range is asked for with it
and checked against its response:
- a strong ETag (S3, GCS, nginx, CDNs): `If-Match`, and the response's own ETag and size. An object replaced
  mid-load is an error, never a mix of two versions: this is the guarantee.
- no strong ETag (a weak `W/` one, Last-Modified alone, or neither): Last-Modified has one-second resolution and is
  kept by copies that keep times (`cp -p`, `rsync -a`, unpacking an archive), so an object swapped for another of
  the same size and Last-Modified answers exactly as before, and tensors could mix both versions. Such an object is
  refused before any of its tensor bytes are read (its headers can still be inspected), unless the caller opts in
  with `STREAMLOAD_ALLOW_UNVALIDATED=1`: the load then warns once and checks what there is (`If-Unmodified-Since`,
  each response's size, Last-Modified and weak ETag); a change that keeps them is seen only by `verify=True` with
  a digest file of per-tensor blocks (`streamload digest`).

A 206 whose Content-Range is not the range asked for is a server (or a cache in front of it) that misbehaves:
refused at once, not retried. Timeouts, resets, 5xx and throttling are retried with backoff (`STREAMLOAD_RETRIES`
times, `STREAMLOAD_TIMEOUT` seconds each); once no request to a store has been answered for the timeout x attempts,
all of them fail (`Silence`): requests queued behind the connection cap do not each wait their own attempts.

Credentials in an HTTP(S) URL (`https://user:password@host/...`) are sent as Basic authorization and kept in the
client only: the storage's paths, hence every message, log line, record and cache folder made from them, carry the
bare URL (a source as the caller wrote it is shown through `base.redacted`). A cloud store's URL with user info is
refused: its keys come from the environment.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from datetime import datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import unquote, urlsplit

from streamload.base import settings
from streamload.base.errors import (
    IntegrityError,
    MissingFileError,
    ReadError,
    SourceError,
    StreamloadError,
    UnsupportedError,
)
from streamload.format.header import FIRST_READ, FileHeader, FileVersion, header_from
from streamload.integrity.blocks import origin_known
from streamload.integrity.digests import DIGEST_FILE, parse, version_of
from streamload.storage.base import (
    INDEX_NAME,
    Copied,
    Digest,
    Known,
    Listing,
    Partly,
    Source,
    file_list,
    first_line,
    is_hex,
    is_index,
    parse_index,
    redacted,
)
from streamload.storage.local import file_identity, pread_full
from streamload.storage.pace import SMALLEST, Pace, Timer, pace_of, restart_all

if TYPE_CHECKING:
    from streamload.storage.cache import Copies

T = TypeVar("T")


def _aws_profile() -> dict[str, Any]:
    """A named profile (`AWS_PROFILE`) is resolved by boto3 where it is installed; keys in the environment,
    instance roles and web identity need none."""
    if not os.environ.get("AWS_PROFILE") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise UnsupportedError(
            f"AWS_PROFILE={os.environ['AWS_PROFILE']}: reading a named profile needs boto3 (pip install boto3), "
            "or export the profile's keys (aws configure export-credentials --format env)"
        ) from None
    return {"credential_provider": Boto3CredentialProvider(boto3.Session())}


class Profile(NamedTuple):
    """One URL scheme's store: how obstore makes its client, what it can do, what its messages say.
    Credentials and endpoint are read by obstore from the environment as the cloud's SDK names them."""

    cloud: str  # as messages name it
    store: str  # obstore's store class
    listable: bool  # a prefix can be listed (an HTTP server cannot: its index, else model.safetensors)
    credentials: str  # the environment that gives them ("": the URL's user info, sent as Basic authorization)
    endpoints: tuple[str, ...] = ()  # variables that may point it at another server (plain http:// allowed there)
    bucket: str = "bucket"  # what the URL's first part names
    missing: str = "NoSuchBucket"  # the error code of a 404 whose bucket is absent
    md5_etag: bool = False  # a strong ETag of 32 hex digits is the object's MD5 (S3's, but for KMS; a multipart
    # upload's is "<hex>-<parts>"); others' ETags are opaque, whatever they look like
    places: str | None = None  # `x@host` with a host ending so names a container and its account, not credentials
    extra: Callable[[], dict[str, Any]] = dict  # more arguments for the store


_S3 = Profile("AWS", "S3Store", True, "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for "
              "temporary keys), or AWS_PROFILE for a named profile (with boto3 installed)",
              ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), md5_etag=True, extra=_aws_profile)  # fmt: skip
_AZURE = Profile("Azure", "AzureStore", True, "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
                 "AZURE_STORAGE_SAS_TOKEN, or AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID",
                 ("AZURE_STORAGE_ENDPOINT", "AZURITE_BLOB_STORAGE_URL"), "container", "ContainerNotFound",
                 places=".core.windows.net")  # fmt: skip
_HTTP = Profile("HTTP", "HTTPStore", False, "", bucket="host", missing="")
PROFILES: dict[str, Profile] = {
    "s3": _S3,
    "gs": Profile("Google Cloud", "GCSStore", True, "GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT (a "
                  "service account's key file), or the instance's service account", ("GOOGLE_BASE_URL",)),
    "az": _AZURE,
    "abfs": _AZURE,
    "http": _HTTP,
    "https": _HTTP,
}  # fmt: skip


class ObjectPath(PurePosixPath):
    """An object's URL as a path, so that `.name`, `.parent` and `/` work as for files."""

    def __str__(self) -> str:
        return super().__str__().replace(":/", "://", 1)  # the path form keeps one slash after the scheme

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    @property
    def root(self) -> str:
        """scheme://bucket-or-host. Raises SourceError naming the URL where it has neither (`s3://`)."""
        if len(self.parts) < 2:
            raise SourceError(f"{self.parts[0] if self.parts else ''}//: names no bucket or host (e.g. "
                              f"{_examples()}, hf://org/name)")  # fmt: skip
        return f"{self.parts[0]}//{self.parts[1]}"

    @property
    def key(self) -> str:
        return "/".join(self.parts[2:])


log = logging.getLogger("streamload")


def _examples() -> str:
    return ", ".join(f"{scheme}://{profile.bucket}/model/" for scheme, profile in PROFILES.items())


def is_url(source: object) -> bool:
    return isinstance(source, str) and "://" in source and source.split("://", 1)[0] in PROFILES


def bare(url: str) -> str:
    """`url` without its user info (`user:password@`), which only the client keeps."""
    scheme, sep, rest = url.partition("://")
    netloc_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, netloc_end)
    if not sep or at < 0 or _names_places(scheme, rest[:at], rest[at + 1 : netloc_end]):
        return url
    return f"{scheme}://{rest[at + 1 :]}"


def _names_places(scheme: str, user: str, host: str) -> bool:
    """Whether a URL's `user@host` names a container and its account (Azure's `container@account.dfs.core.
    windows.net`), not credentials: no password in it, and the host an account's."""
    profile = PROFILES.get(scheme)
    return profile is not None and profile.places is not None and ":" not in user and host.endswith(profile.places)


def _authorization(root: str) -> str | None:
    """The Basic authorization that the user info of `root` stands for; None without one."""
    if bare(root) == root:
        return None
    parts = urlsplit(root)
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")


class ObjectStorage:
    """The objects under one `scheme://bucket` (or `scheme://host`)."""

    local = False
    first_batch = SMALLEST  # a first tensor after its own bytes and a first-byte wait or two, not a slot's

    def __init__(self, root: str, cache_dir: Path | None = None) -> None:
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise UnsupportedError(
                f"{redacted(root)}: reading from object storage needs obstore: pip install -e '.[remote]'"
            ) from None
        self.profile = PROFILES[root.split("://", 1)[0]]
        authorization = _authorization(root)
        if authorization is not None and self.profile.credentials:
            raise SourceError(f"{redacted(root)}: credentials in the URL are not used: {self.profile.cloud} takes "
                              f"them from the environment: set {self.profile.credentials}")  # fmt: skip
        self.root = bare(root)  # the credentials live in the client only, never in a path
        self.store = _Store(self.root, authorization)
        self.cache_dir = cache_dir
        self.retries = settings.RETRIES.get()
        self.pace = pace_of(root)
        self.silence = Silence(_timeout(), self.retries + 1)  # shared by every request: one verdict per store

    # -- listing and headers ------------------------------------------------------------------------
    def locate(self, source: Source) -> Listing:
        if not isinstance(source, str):
            return file_list([self._path(str(s)) for s in source])
        path = self._path(source)
        if path.name.endswith(".safetensors") and not source.endswith("/"):
            return Listing([path])
        if is_index(path.name) and not source.endswith("/"):
            return self._index(path)
        return self._directory(path if len(path.parts) > 2 else ObjectPath(path.root + "/"))

    def _directory(self, prefix: ObjectPath) -> Listing:
        index = prefix / INDEX_NAME
        if not self.profile.listable:  # an index, else the usual single-file name
            try:
                return self._index(index)
            except MissingFileError:
                single = prefix / "model.safetensors"
                try:
                    self.call(lambda: _obstore().head_async(self.store.get(), single.key), single)
                except MissingFileError:
                    raise SourceError(
                        f"{prefix}/: neither {INDEX_NAME} nor model.safetensors is there "
                        "(an HTTP server cannot be listed: name the file)"
                    ) from None
                return Listing([single])
        key = prefix.key.rstrip("/")
        below = key + "/" if key else None
        listed = self.call(lambda: _obstore().list_with_delimiter_async(self.store.get(), prefix=below), prefix)
        names = sorted(o["path"].rsplit("/", 1)[-1] for o in listed["objects"])
        if INDEX_NAME in names:
            return self._index(index)
        found = [prefix / n for n in names if n.endswith(".safetensors")]
        if not found:
            raise SourceError(f"{prefix}/: holds no *.safetensors object")
        return Listing(found)

    def _index(self, index: ObjectPath) -> Listing:
        data, _ = self.call(lambda: _get(self.store, index.key, None, None), index)
        return parse_index(index, bytes(data))

    def header(self, path: PurePath) -> FileHeader:
        assert isinstance(path, ObjectPath)
        head, meta = self.call(lambda: _get(self.store, path.key, (0, FIRST_READ), None), path, (0, FIRST_READ))
        identity = _identity(meta)

        def read_at(offset: int, n: int) -> bytes:
            got = self.call(lambda: _get(self.store, path.key, (offset, offset + n), identity), path, (offset, n))
            return bytes(got[0])

        return header_from(path, identity.size, bytes(head), read_at)._replace(identity=identity)

    def open(
        self,
        headers: dict[PurePath, FileHeader],
        partly: Partly = None,
        files: Callable[..., ObjectFiles] | None = None,
    ) -> ObjectFiles:
        """The objects of a load, refused before any byte is read where one has no strong ETag (the module's
        docstring); `files`: what reads them (peers.py passes one that reads from peers first)."""
        if weak := _unvalidated(tuple(headers.values())):
            _refuse_or_warn(weak)
        return (files or ObjectFiles)(self, headers, partly)

    def cached(self, headers: tuple[FileHeader, ...]) -> Copied | None:
        """The cache's complete copies, each checked by the integrity layer against the origin's digest file
        where it publishes one bound to these versions; else only where every copy is this user's own (another
        user's copy could hold anything: the load then reads from the origin, one warning)."""
        from streamload.storage.cache import RECORD, lookup

        if self.cache_dir is None or (_unvalidated(headers) and not settings.ALLOW_UNVALIDATED.get()):
            return None  # a copy is only as sure as the load that made it: open() says why
        paths = lookup(self.cache_dir, headers)
        if paths is None:
            return None
        try:  # each copy judged as it is now (a link is its maker's); the load reads it only while it is so
            stats = [os.lstat(p) for p in paths]
            mine = [
                st.st_uid == os.lstat(f"{p}{RECORD}").st_uid == os.geteuid() for p, st in zip(paths, stats, strict=True)
            ]
        except OSError:
            return None
        foreign = [(h, p) for h, p, own in zip(headers, paths, mine, strict=True) if not own]
        docs = origin_digests(self, (h.path for h, _ in foreign))
        checks: dict[PurePath, Known] = {}
        for header, path in foreign:  # each checked against the blocks of its origin's digest file, if bound
            where = f"{header.path.parent}/{DIGEST_FILE}"
            known, _ = origin_known(header, docs[header.path.parent][0], where, version_of(header, self.digest(header)))
            if known is None:
                return None  # read through the load's `Copies`, which reads such a copy's object from the origin
            checks[path] = known
        return Copied(paths, checks, [file_identity(st) for st in stats])

    def digest(self, header: FileHeader) -> Digest | None:
        """The ETag, where the store vouches that it is the object's MD5 (`Profile.md5_etag`): what `verify=` checks
        the whole object against and binds a digest entry by (`digests.version_of`); other stores' are opaque."""
        etag = (header.identity.etag or "" if header.identity else "").strip('"').lower()
        if self.profile.md5_etag and len(etag) == 32 and is_hex(etag):
            return Digest("md5", etag, "the object's ETag")
        return None

    def held_until_checked(self) -> ObjectStorage:
        return self  # nothing it serves waits for a verdict

    def sidecar(self, near: PurePath, name: str) -> bytes | None:
        """The object `name` beside `near`; None if it is absent, or refused (S3 answers 403 for a missing
        key to a caller without ListBucket). Kept in the cache, where there is one, beside the copies."""
        assert isinstance(near, ObjectPath)
        near = ObjectPath(bare(str(near)))  # a caller's path may still hold the user info of the URL it was given
        path = ObjectPath(str(near.parent) + "/" + name) if near.parent != near else near
        try:
            data, _ = self.call(lambda: _get(self.store, path.key, None, None), path)
        except MissingFileError:
            return None
        except ReadError as exc:
            log.warning("streamload: %s: taken as absent: %s", path, exc)
            return None
        if self.cache_dir is not None:
            from streamload.storage.cache import cache_path, keep

            keep(cache_path(self.cache_dir, path), bytes(data), root=self.cache_dir)
        return bytes(data)

    def _path(self, url: str) -> ObjectPath:
        path = ObjectPath(bare(url))
        if not is_url(url) or len(path.parts) < 2:
            raise SourceError(f"{redacted(url)}: not an object URL ({_examples()})")
        if path.root != self.root:
            raise SourceError(f"{redacted(url)}: every file of a checkpoint must be under {self.root}")
        return path

    # -- requests -----------------------------------------------------------------------------------
    def call(
        self, request: Callable[[], Coroutine[Any, Any, T]], path: PurePath, span: tuple[int, int] | None = None
    ) -> T:
        """Run a request on the loop thread, again after what may pass (see `attempts`); blocks."""
        return self.wait(self.attempts(lambda ticket: request(), path, span, measured=False), path)

    def wait(
        self,
        work: Coroutine[Any, Any, T],
        path: PurePath,
        pending: set[concurrent.futures.Future[Any]] | None = None,
        stopped: threading.Event | None = None,
    ) -> T:
        """Run `work` on the loop thread and wait for it; `pending` holds it meanwhile, for `cancel`."""
        if stopped is not None and stopped.is_set():
            work.close()
            raise ReadError(_closed(path))
        if _EXITING.is_set():
            work.close()
            raise ReadError(_exiting(path))
        future = asyncio.run_coroutine_threadsafe(work, _loop())
        if pending is not None:
            pending.add(future)
            if stopped is not None and stopped.is_set():  # cancel() ran between the check and add
                future.cancel()
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise ReadError(_closed(path)) from None
        finally:
            if pending is not None:
                pending.discard(future)

    async def attempts(
        self,
        request: Callable[[tuple[int, int]], Coroutine[Any, Any, T]],
        path: PurePath,
        span: tuple[int, int] | None = None,
        stopped: threading.Event | None = None,
        measured: bool = True,
    ) -> T:
        """`request`, again after what may pass (timeouts, resets, 5xx, 429) with jittered exponential
        backoff, each attempt once the store's pace gives it a connection; an error that will not pass
        is raised at once, named."""
        last: BaseException | None = None
        timed_out = 0  # attempts that ran out the timeout: a server that accepts and never answers says nothing
        attempt = 0
        first = time.monotonic()
        silence = self.silence
        while attempt <= self.retries:
            if stopped is not None and stopped.is_set():
                raise ReadError(_closed(path))
            silence.check(path, span)  # the store has been silent for the whole budget: no request waits longer
            ticket = await self.pace.acquire(measured)
            silence.check(path, span, release=self.pace.release)
            began = time.monotonic()
            try:
                result = await request(ticket)
                silence.heard()
                return result
            except Exception as exc:
                if not _transient(exc):
                    raise _named(exc, path, span) from exc
                last = exc
                if time.monotonic() - began >= 0.9 * _timeout():  # first: a timeout reads "error sending request" too
                    timed_out += 1
                    silence.timed_out(began)
                    if attempt < self.retries:  # minutes may pass in silence otherwise
                        silence.check(path, span, exc=exc)  # unless the store has said nothing for all of them
                        log.warning("streamload: %s: %s got no answer within %g s; trying again (attempt %d of %d)",
                                    path, _what(span), _timeout(), attempt + 2, self.retries + 1)  # fmt: skip
                elif any(words in str(exc).lower() for words in _CONNECTION_REFUSED) and self.pace.refused(ticket):
                    attempt -= 1  # fewer connections now: this one is tried again at no cost
                else:
                    silence.heard()  # an answer (503, a reset mid-body): the server is there
            finally:
                self.pace.release()
            attempt += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** max(0, attempt - 1)) * (0.5 + random.random()))  # nosec B311 # jitter
        waited, tries = time.monotonic() - first, self.retries + 1
        said = f"failed after {tries} attempts ({waited:.1f} s in all)"
        if timed_out:
            said = (
                f"got no answer within {_timeout():g} s in {timed_out} of {tries} attempts ({waited:.1f} s in all; "
                "STREAMLOAD_TIMEOUT, STREAMLOAD_RETRIES)"
            )
        raise ReadError(f"{path}: {_what(span)} {said}: {first_line(last)}") from last


class Silence:
    """How long a store has answered none of its requests. Many requests wait on one store behind its connection
    cap: retried each on its own, they would time out one after another, `timeout` x `attempts` x (requests /
    connections) in all. Once none has been answered for `timeout` x `attempts` (a server that accepts, then
    stalls), every request of the store fails, naming how long it waited; any answer starts the count again.
    Used on the requests' loop thread only."""

    def __init__(self, timeout: float, attempts: int) -> None:
        self.timeout, self.attempts = timeout, attempts
        self.since: float | None = None  # when the first request not answered since the last answer began
        self.last_timeout = 0.0  # when a request last ran out its time
        self.heard_at = 0.0
        self.count = 0  # requests that ran out their time since `since`
        self.verdict: str | None = None

    def heard(self) -> None:
        self.since, self.count, self.verdict, self.heard_at = None, 0, None, time.monotonic()

    def timed_out(self, began: float) -> None:
        """A request that began at `began` ran out its time; past the budget, the store's verdict."""
        now = self.last_timeout = time.monotonic()
        if self.since is None:
            self.since = max(began, self.heard_at)
        self.count += 1
        silent = now - self.since
        if self.verdict is None and silent >= 0.9 * self.timeout * self.attempts:
            self.verdict = (
                f"the server answered none of {self.count} requests for {silent:.1f} s in all (each "
                f"{self.timeout:g} s, {self.attempts} attempts: STREAMLOAD_TIMEOUT, STREAMLOAD_RETRIES)"
            )

    def check(
        self,
        path: PurePath,
        span: tuple[int, int] | None,
        release: Callable[[], None] | None = None,
        exc: BaseException | None = None,
    ) -> None:
        """Raise the verdict, while it stands (a request ran out its time within the last `timeout`: the
        server still says nothing; a later load on the same storage tries again). `release`: the
        connection this request holds, handed back first."""
        if self.verdict is None:
            return
        if time.monotonic() - self.last_timeout > self.timeout:  # stale: nothing has been asked since
            self.since, self.count, self.verdict = None, 0, None
            return
        if release is not None:
            release()
        raise ReadError(f"{path}: {_what(span)}: {self.verdict}" + (f": {first_line(exc)}" if exc else ""))


class ObjectFiles:
    """The objects one load reads, with the identity each must keep; reads can be cancelled."""

    def __init__(self, storage: ObjectStorage, headers: dict[PurePath, FileHeader], partly: Partly = None) -> None:
        self.storage = storage
        self._identity = {path: h.identity for path, h in headers.items()}
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._stopped = threading.Event()
        _loop().call_soon_threadsafe(storage.pace.restart)
        self._copies: Copies | None = None
        if storage.cache_dir is not None:
            from streamload.storage.cache import Copies

            self._copies = Copies(storage.cache_dir, headers, partly() if partly else ())

    def read(self, path: PurePath, offset: int, length: int) -> list[memoryview]:
        """`length` bytes at `offset`, from the version whose header was read: in ranges of the store's request
        size (storage/pace.py), fetched at once."""
        assert isinstance(path, ObjectPath)
        copies = self._copies
        fd = None if copies is None else copies.local(path)
        if fd is not None:  # a complete copy in the cache (or one another writer just completed)
            return [_pread(fd, path, offset, length)]
        views = self.fetch(path, offset, length)
        if copies is not None:  # here, not on the loop thread, which serves every request
            at = offset
            for view in views:
                copies.write(path, at, view)
                at += len(view)
        return views

    def fetch(self, path: ObjectPath, offset: int, length: int) -> list[memoryview]:
        """`length` bytes at `offset` from the store (a subclass may get them elsewhere: peers.py)."""
        size = self.storage.pace.request_bytes()
        spans = [(at, min(size, offset + length - at)) for at in range(offset, offset + length, size)]

        async def every() -> list[memoryview]:
            tasks = [asyncio.ensure_future(self._range(path, span)) for span in spans]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:  # one failed or all were cancelled: none is left running
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        return self.storage.wait(every(), path, self._pending, self._stopped)

    async def _range(self, path: ObjectPath, span: tuple[int, int]) -> memoryview:
        want = self._identity[path]
        offset, length = span
        storage = self.storage
        data, meta = await storage.attempts(
            lambda ticket: _get(storage.store, path.key, (offset, offset + length), want, (storage.pace, ticket)),
            path,
            span,
            self._stopped,
        )
        now = _identity(meta)
        if want and now != want:
            raise ReadError(f"{path}: object changed after its header was read (was {want}, now {now})")
        view = memoryview(data)
        if len(view) != length:
            raise ReadError(f"{path}: {_what(span)}: got {len(view)} bytes (truncated since its header?)")
        return view

    def unkept(self, path: PurePath) -> None:
        """No copy of `path` is kept from this load: some of its bytes were handed out unchecked."""
        if self._copies is not None:
            self._copies.drop(path)

    def cancel(self) -> None:
        self._stopped.set()
        if self._copies is not None:
            self._copies.stopped.set()  # a wait for another writer ends too
        for future in list(self._pending):
            future.cancel()  # drops the request: its connection is closed

    def close(self) -> None:
        self.cancel()
        if self._copies is not None:
            self._copies.close()


Digests = tuple[dict[str, Any] | None, str]  # a folder's digest file as parsed (None: absent or broken), and why


def origin_digests(storage: ObjectStorage, paths: Iterable[PurePath]) -> dict[PurePath, Digests]:
    """{folder of `paths`: (its digest file parsed, or None; why where it could not be)}, each read once."""
    out: dict[PurePath, Digests] = {}
    for path in paths:
        folder = path.parent
        if folder not in out:
            raw = storage.sidecar(path, DIGEST_FILE)
            try:
                out[folder] = (None if raw is None else parse(raw, f"{folder}/{DIGEST_FILE}"), "")
            except IntegrityError as exc:
                out[folder] = (None, str(exc))
    return out


def _pread(fd: int, path: PurePath, offset: int, length: int) -> memoryview:
    """`length` bytes at `offset` of a complete local copy of the object at `path`."""
    try:
        view = pread_full(fd, length, offset)
    except OSError as exc:
        raise ReadError(f"{path}: reading its cached copy at bytes {offset}..{offset + length} failed: {exc}") from exc
    if len(view) < length:
        raise ReadError(f"{path}: its cached copy ends at {offset + len(view)} (cut short since it was completed?)")
    return view


# -- the loop thread and the requests -----------------------------------------------------------------
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()
_EXITING = threading.Event()  # set at interpreter exit: no request is made after it
_EXIT_WAIT = 5.0  # seconds the exit waits for the requests in flight to be dropped
_EXIT_GRACE = 0.1  # then, seconds for each dropped request's Rust task to let go of the GIL
_AT_EXIT = False  # `_wind_down` registered (once a process: a forked child inherits its parent's atexit)


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP, _AT_EXIT
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="streamload-objects", daemon=True).start()
            if not _AT_EXIT:
                atexit.register(_wind_down)
                _AT_EXIT = True
            _LOOP = loop
        return _LOOP


def _forked() -> None:
    """In a child just forked: none of its parent's threads exist in it (the loop thread, obstore's runtime), so
    a request sent to the parent's loop would wait for ever, and so would the child's exit. The child starts its
    own loop and obstore on first use (`_loop`, `_native`); each store's count of requests in flight starts afresh
    (`restart_all`: a storage made before the fork holds the same `Pace`)."""
    global _LOOP, _LOOP_LOCK, _NATIVE_LOCK
    _LOOP_LOCK, _NATIVE_LOCK = threading.Lock(), threading.Lock()  # a parent's thread may have held them
    _LOOP = None  # the parent's: its selector stays open, unused (closing it would need asyncio's internals)
    restart_all()


os.register_at_fork(after_in_child=_forked)


def _wind_down() -> None:
    """At interpreter exit (atexit, before finalization): drop every request in flight and make no more.
    A request is a task on obstore's Rust runtime that takes the GIL once more when it ends or is dropped; a
    thread that takes the GIL while the interpreter finalizes is ended by `pthread_exit`, which cannot unwind
    through Rust frames: the process aborts (SIGABRT; Python < 3.14). So a program that exits while a load runs
    in another thread (a daemon thread, a Ctrl-C) has its reads fail at once, and the tasks let go first."""
    _EXITING.set()
    loop = _LOOP
    if loop is None or loop.is_closed() or not loop.is_running():
        return

    async def drop_all() -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()  # each awaited obstore future's cancellation tells its Rust task to drop the request
        if tasks:
            await asyncio.wait(tasks, timeout=_EXIT_WAIT)

    try:
        asyncio.run_coroutine_threadsafe(drop_all(), loop).result(_EXIT_WAIT + 1)
    except Exception:  # nosec B110 # the loop stopped meanwhile: nothing is in flight on it
        pass
    time.sleep(_EXIT_GRACE)  # the GIL free meanwhile: each dropped task takes it once and ends


def _exiting(path: PurePath) -> str:
    return f"{path}: not read: the process is exiting"


def _obstore() -> Any:
    """obstore, for a request about to be made; none is once the process is exiting (`_wind_down`)."""
    if _EXITING.is_set():
        raise _Exiting
    return _native().api


class _Exiting(Exception):
    """A request not made: the process is exiting."""


class _Obstore(NamedTuple):
    """The obstore a process makes its requests with: its functions, store classes and exceptions."""

    api: Any
    stores: Any
    errors: Any


_NATIVE: tuple[int, _Obstore] | None = None  # (the process id it was loaded for, it)
_NATIVE_LOCK = threading.Lock()


def _native() -> _Obstore:
    """The obstore this process can use. obstore runs every async request on one tokio runtime made once a
    process, with no fork handling: in a forked child its threads are gone and a request is never polled (it
    hangs for ever). So a forked child loads obstore's native module afresh (`_fresh_obstore`), with a runtime
    of its own; stores are made per process (`_Store`), as the child's obstore refuses the parent's."""
    global _NATIVE
    with _NATIVE_LOCK:
        if _NATIVE is None:
            import obstore
            import obstore.exceptions
            import obstore.store

            _NATIVE = (os.getpid(), _Obstore(obstore, obstore.store, obstore.exceptions))
        elif _NATIVE[0] != os.getpid():  # a forked child (or a child's child)
            module = _fresh_obstore()
            _NATIVE = (os.getpid(), _Obstore(module, module._store, module.exceptions))
        return _NATIVE[1]


def _fresh_obstore() -> Any:
    """obstore's native module loaded again from a copy of its file (removed once loaded: the loader maps it), so
    that its statics (the tokio runtime) are new; `sys.modules` is put back as it was (the caller's `import
    obstore` stays the one it had). About 15 MB copied, once per forked child that makes a request."""
    import importlib.util
    import shutil
    import sys
    import tempfile

    import obstore._obstore as inherited

    before = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "obstore"}
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix="streamload-obstore-")
        path = shutil.copy(inherited.__file__, folder)
        spec = importlib.util.spec_from_file_location(inherited.__name__, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path}: not a loadable module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        raise UnsupportedError(
            "this process was forked from one that made requests with obstore, whose runtime does not survive a "
            f"fork, and a fresh copy of obstore could not be loaded from {folder or tempfile.gettempdir()} ({exc}): "
            "start it with multiprocessing's 'spawn' or 'forkserver', or set TMPDIR to a folder that allows "
            "executables"
        ) from None
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        for name in [name for name in sys.modules if name.split(".")[0] == "obstore"]:
            del sys.modules[name]
        sys.modules.update(before)
    return module


def _timeout() -> float:
    """Seconds a request may take, each attempt (STREAMLOAD_TIMEOUT)."""
    return settings.TIMEOUT.get()


class _Store:
    """The obstore store of one root, made in each process at its first request there (`_native`); credentials
    it cannot use (a key file absent or broken) are then an error naming the object asked for."""

    def __init__(self, root: str, authorization: str | None) -> None:
        self._root, self._authorization = root, authorization
        self._made: tuple[int, Any] | None = None  # (the process it was made in, it): used on the loop thread only

    def get(self) -> Any:
        if self._made is None or self._made[0] != os.getpid():
            try:
                self._made = (os.getpid(), _made_store(self._root, self._authorization))
            except StreamloadError:
                raise
            except Exception as exc:  # obstore's own, for credentials or options it cannot use
                profile = PROFILES[self._root.split("://", 1)[0]]
                raise SourceError(f"the {profile.cloud} client cannot be made from {profile.credentials or 'the URL'}: "
                                  f"{first_line(exc)}") from exc  # fmt: skip
        return self._made[1]


def _made_store(root: str, authorization: str | None) -> Any:
    profile = PROFILES[root.split("://", 1)[0]]
    # Given client options, obstore no longer reads the SDK's *_ALLOW_HTTP: an endpoint set to http:// allows it
    plain = root.startswith("http://") or any(os.environ.get(v, "").startswith("http://") for v in profile.endpoints)
    options: dict[str, Any] = {"timeout": f"{_timeout()}s", "connect_timeout": "5s", "allow_http": plain}
    if authorization is not None:  # the URL's user info (obstore would neither send it nor keep it out of errors)
        options["default_headers"] = {"Authorization": authorization}
    retry = {"max_retries": 0}  # retried by ObjectStorage.call, which also sees errors in a body
    store = getattr(_native().stores, profile.store)
    return store.from_url(root, client_options=options, retry_config=retry, **profile.extra())


async def _get(
    store: _Store,
    key: str,
    span: tuple[int, int] | None,
    identity: FileVersion | None,
    paced: tuple[Pace, tuple[int, int]] | None = None,  # the store's pace and the request's ticket, to learn
) -> Any:
    obstore = _obstore()
    options: dict[str, Any] = {}
    if span is not None:
        options["range"] = span
    if identity and identity.etag:
        options["if_match"] = identity.etag
    elif identity and identity.modified:  # no strong ETag: the server checks what it can
        options["if_unmodified_since"] = identity.modified
    timer = Timer()
    result = await obstore.get_async(store.get(), key, options=options)
    timer.headers()
    data = await result.bytes_async()
    if paced is not None:
        paced[0].record(timer.sample(len(data), paced[1]))
    return data, result.meta


def _identity(meta: Any) -> FileVersion:
    """The version a response names: its size, a strong ETag, else what the server gives (a weak ETag,
    Last-Modified); and the object's generation where the store keeps versions (GCS, versioned S3)."""
    size, tag, modified = int(meta["size"]), meta.get("e_tag"), meta.get("last_modified")
    generation = meta.get("version")
    if isinstance(modified, datetime) and modified.timestamp() == 0:
        modified = None  # obstore's stand-in for a response without Last-Modified
    if tag and not tag.startswith("W/"):
        return FileVersion(size, etag=tag, generation=generation)
    return FileVersion(size, weak=tag or None, modified=modified, generation=generation)


def _unvalidated(headers: tuple[FileHeader, ...]) -> list[PurePath]:
    """The objects whose server gave no strong ETag: a change to them may go unseen."""
    return [h.path for h in headers if h.identity and h.identity.etag is None]


def _refuse_or_warn(weak: list[PurePath]) -> None:
    """Refuse objects without a strong validator, or (allowed) say once what is and is not checked."""
    more = f" (and {len(weak) - 1} more)" if len(weak) > 1 else ""
    allow = settings.ALLOW_UNVALIDATED
    if not allow.get():
        raise UnsupportedError(
            f"{weak[0]}{more}: the server sends no strong ETag, so a change to the object while it loads "
            "cannot be told for sure (Last-Modified has one-second resolution and is kept by copies that keep "
            f"times) and tensors could mix two versions; refused before reading. {allow.name}=1 loads it, "
            "checking each range's size and Last-Modified; with verify=True and a digest file (`streamload "
            "digest`) every tensor is also checked against its digests before it is handed out"
        )
    log.warning(
        "streamload: %s%s: the server sends no strong ETag (%s=1): each range is checked against the size and "
        "Last-Modified read with the header, but a change that keeps both is not seen (verify=True with a digest "
        "file sees it)", weak[0], more, allow.name,
    )  # fmt: skip


def _closed(path: PurePath) -> str:
    return f"{path}: the stream was closed (by close() from another thread) while being read"


# How a store that caps its connections turns one away: refused, or accepted and closed before the
# request went out (hyper's "error sending request"); a request sent and dropped unanswered is not this.
_CONNECTION_REFUSED = ("error sending request", "connection refused", "connection reset")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (_Exiting, StreamloadError)):  # ours (the client could not be made, obstore not loaded)
        return False
    ox = _native().errors  # the exceptions of the obstore that raised it (a forked child's own)
    final = (ox.NotFoundError, ox.PreconditionError, ox.NotSupportedError, ox.PermissionDeniedError,
             ox.UnauthenticatedError, ox.InvalidPathError, FileNotFoundError)  # fmt: skip
    # a listing's 403 comes as a generic error: its status is read from the text
    return not (isinstance(exc, final) or _no_credentials(exc) or _wrong_range(exc) or _FINAL_STATUS.search(str(exc)))


_FINAL_STATUS = re.compile(r"(status:|HTTP status|status code:) (400|401|403|404|412)\b")
_METADATA_SERVICE = "169.254.169.254"  # where a cloud client asks for an instance role's keys when given none
_REFUSED = ("403", "401", "denied", "refused", "unreachable", "No route")  # not a passing timeout or 429


def _no_credentials(exc: BaseException) -> bool:
    """A cloud store given no credentials: the client fell back to the instance metadata service, which
    is absent or refused (off the cloud), and reports that service's answer, not the missing keys."""
    text = str(exc)
    return _METADATA_SERVICE in text and any(word in text for word in _REFUSED)


_WRONG_RANGE = re.compile(r"Requested (\d+)\.\.(\d+), got (\d+)\.\.(\d+)")


def _wrong_range(exc: BaseException) -> re.Match[str] | None:
    """A 206 whose Content-Range is not the range asked for (obstore's UnexpectedRange)."""
    return _WRONG_RANGE.search(str(exc))


def _named(exc: BaseException, path: PurePath, span: tuple[int, int] | None) -> BaseException:
    if isinstance(exc, _Exiting):
        return ReadError(_exiting(path))
    if isinstance(exc, StreamloadError):  # ours, made for this request: named, its other attributes kept
        exc.args = (f"{path}: {exc}", *exc.args[1:])
        return exc
    ox = _native().errors
    profile = PROFILES.get(str(path).split("://", 1)[0], _HTTP)
    if wrong := _wrong_range(exc):
        asked, got = (int(wrong[1]), int(wrong[2]) - 1), (int(wrong[3]), int(wrong[4]) - 1)
        return ReadError(
            f"{path}: the server misbehaves: asked for bytes {asked[0]}-{asked[1]}, it answered 206 with "
            f"Content-Range bytes {got[0]}-{got[1]}; refused (not retried: its answers cannot be trusted)"
        )
    if profile.missing and profile.missing in str(exc):  # a 404 with an XML body: name the bucket and key
        parts = PurePath(path).parts
        bucket, key = (parts[1], "/".join(parts[2:])) if len(parts) > 1 else (str(path), "")
        return MissingFileError(f"{path}: no such {profile.bucket} {bucket!r} (asked for the key {key!r})")
    if isinstance(exc, (ox.NotFoundError, FileNotFoundError)):
        return MissingFileError(f"{path}: no such object")
    if _no_credentials(exc) and profile.credentials:
        return ReadError(
            f"{path}: no {profile.cloud} credentials: set {profile.credentials}; on a cloud instance its role "
            f"provides them, but the instance metadata service did not ({first_line(exc)})"
        )
    if isinstance(exc, ox.PreconditionError):
        return ReadError(
            f"{path}: object changed after its header was read (412: its ETag no longer matches, or it was "
            "modified since its Last-Modified)"
        )
    if isinstance(exc, ox.NotSupportedError) and "Range" in str(exc):
        return UnsupportedError(f"{path}: the server does not honour HTTP Range requests, which streaming needs")
    final = _FINAL_STATUS.search(str(exc))  # a listing's refusal comes as a generic error
    if isinstance(exc, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or (final and final[2] in ("401", "403")):
        given = profile.credentials or "the URL's user info"
        return ReadError(f"{path}: access denied: check the credentials ({given}): {first_line(exc)}")
    return ReadError(f"{path}: {_what(span)} failed: {first_line(exc)}")


def _what(span: tuple[int, int] | None) -> str:
    if span is None:
        return "the request"
    offset, n = span
    return f"reading bytes {offset}-{offset + n - 1}"
