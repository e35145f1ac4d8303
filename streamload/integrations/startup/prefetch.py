"""A checkpoint fetched ahead of its load, by a process of its own, while something else goes on (a
server importing, spawning workers, building its model): local files into the page cache, object
storage into a cache directory. The load that follows then reads from memory or local disk.

    python -m streamload.integrations.startup.prefetch SOURCE --done FILE [--cache-dir DIR] [--budget BYTES]

A server's fetch, started with its process (`ahead`: before `from vllm import LLM`, or `streamload
serve -- vllm serve ...`), is published in the environment (`ENV`) for the load format to adopt.

No torch is imported (the process starts in milliseconds). It reads the files a load reads, as a load
does (object storage into `cache_dir`, `storage/cache.py`), holding nothing but the page cache. A
checkpoint larger than `budget` (local: half the memory available; remote: the cache directory's free
space) is not fetched. It ends by writing FILE (JSON: `{"ok": true, "bytes": n}`, or `"ok": false` with
the reason), and with the process that started it, so a server stopped mid-start-up leaves no fetch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess  # nosec B404 # this package's own fetch process, an argv list, no shell
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamload.base import atomic, leftovers, settings
from streamload.base.tuning import available_memory, reader_threads
from streamload.storage.base import redacted

if TYPE_CHECKING:
    from collections.abc import Sequence

ENV = settings.FETCH.name  # the fetch this process (or the one that started it) began: JSON, see `ahead`
MODULE = "streamload.integrations.startup.prefetch"  # run as `python -m`, and found so in /proc (`_is_prefetch`)
log = logging.getLogger("streamload")


@dataclass
class Prefetch:
    """A prefetch under way: its process id, and `done`, where it reports."""

    pid: int
    done: Path

    seeding: str | None = None  # the URL its seeder serves `cache_dir` at, from its start ("": it could not)

    def running(self) -> bool:
        return _is_prefetch(self.pid, self.done)

    def stop(self) -> None:
        """End it now if it still runs (idempotent): a fetch that seeds serves on after its report. Where the
        id is no longer a prefetch's (it ended long ago and the id went to another process), nothing is
        signalled."""
        if not self.running():
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while _alive(self.pid):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                return
            time.sleep(0.02)


def start(
    source: str,
    done: Path,
    cache_dir: Path | None = None,
    model_infos: bool = False,
    compile_caches: Path | None = None,
    pinned: frozenset[str] = frozenset(),
    work: Path | None = None,
    peers: Sequence[str] = (),
    seed: dict[str, Any] | None = None,
) -> Prefetch:
    """Start fetching `source` in a process of its own; it ends when this process does (or `stop`).
    `work`: a directory this process made (`leftovers.make`) for the fetch, which the fetch removes
    when it sees this process ended (its exit handlers, which would remove it, did not run). It is no
    child of this process (one that ended would stay a zombie, nothing here reaping it while a server
    runs): a short-lived child starts it and exits. `seed`: the Seeder's arguments (servers/seed.py) to
    serve `cache_dir` with from the fetch's start, what it has verified while it still fetches (a wave's
    nodes split the checkpoint so: storage/wave.py), until it ends; `Prefetch.seeding` says where."""
    argv = [sys.executable, "-m", MODULE, source, "--done", str(done), "--watch", str(os.getpid())]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    if model_infos:
        argv += ["--model-infos"]
    if compile_caches is not None:
        argv += ["--compile-caches", str(compile_caches), *(f"--pin={pin}" for pin in sorted(pinned))]
    if work is not None:
        argv += ["--work", str(work)]
    argv += [f"--peers={peer}" for peer in peers]
    if seed is not None:
        argv += ["--seed", json.dumps(seed)]
    # unbuffered: the fetch's own line after the starter's is waited for a bounded time (`_line_within`)
    starter = subprocess.Popen(  # nosec B603 # argv built here
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0
    )
    assert starter.stdout is not None
    with starter.stdout:
        line = starter.stdout.readline()
        # the fetch's own line, once its seeder is bound (EOF: it ended first)
        seeding = _line_within(starter.stdout, SEED_START) if seed is not None and line.strip().isdigit() else None
    starter.wait()
    if not line.strip().isdigit():
        raise RuntimeError(f"the prefetch of {redacted(source)} did not start (exit status {starter.returncode})")
    prefetch = Prefetch(int(line), done)
    atexit.register(prefetch.stop)
    if seeding is not None:
        prefetch.seeding = seeding if seeding.startswith(("http://", "https://")) else ""
        if not prefetch.seeding:
            log.warning("streamload: cannot seed %s (%s): the fetch goes on without seeding", cache_dir,
                        seeding.removeprefix("! ") or "the fetch ended first")  # fmt: skip
    return prefetch


def ahead(
    source: str,
    cache_dir: str | os.PathLike[str] | None = None,
    compile_cache: Any = None,
    peers: str | Sequence[str] | None = None,
    seed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Start fetching `source` for a server this process is about to start, and publish the fetch in
    the environment (`ENV`), where streamload's vLLM load format, in this process or any it starts,
    adopts it instead of starting another. Call it first, before importing vLLM (seconds of imports
    that the download then overlaps):

    >>> from streamload.integrations.startup import prefetch  # doctest: +SKIP
    >>> prefetch.ahead("s3://bucket/llama/")  # doctest: +SKIP
    >>> from vllm import LLM  # doctest: +SKIP

    Local files are read into the page cache; object storage is written into `cache_dir`, or without
    one into a private staging directory, removed once the engine has loaded (or when this process
    exits, as the fetch does). Returns what the loader needs to find the weights (also `ENV`'s value).
    `compile_cache`: the digests of the compiled-artifact archives published beside the weights that
    this node trusts (`pinned_digests.py`), fetched first; none without. `peers`: nodes seeding the
    weights, read from first (storage/peers.py). `seed`: the Seeder's arguments (servers/seed.py) to serve
    `cache_dir` with from now on, the fetch's verified bytes while it runs (a remote source's only; the
    returned "seeding": where, "" where it could not), until this process ends or `stop_seeding`."""
    from streamload.integrations.startup.pinned_digests import pins
    from streamload.storage.peers import names

    pinned = pins(compile_cache)
    remote = "://" in source
    leftovers.sweep(STAGING)  # what fetches ended without clean-up (SIGKILL, OOM) left: their owners are gone
    work = leftovers.make(STAGING)
    staging: Path | None = None
    try:
        if remote:
            staging = Path(cache_dir) if cache_dir else work / "staged"
            staging.mkdir(parents=True, exist_ok=True)
        compiled = work / "compiled" if remote and pinned else None  # a local archive is read where it lies
        seeds = seed if remote and cache_dir else None  # what a load keeps: a private staging folder goes
        fetching = start(source, work / "done.json", staging, model_infos=True, compile_caches=compiled, pinned=pinned,
                         work=work, peers=names(peers), seed=seeds)  # fmt: skip
        leftovers.share(work, fetching.pid)  # it writes there until it sees this process gone
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise

    def clean_up() -> None:  # the process that started the fetch is ending
        fetching.stop()
        shutil.rmtree(work, ignore_errors=True)

    atexit.register(clean_up)
    started = {
        "source": source,
        "host": socket.gethostname(),
        "pid": fetching.pid,
        "done": str(work / "done.json"),
        "compiled": str(compiled) if compiled else None,  # compiled-artifact archives fetched first
        "cache_dir": str(staging) if staging is not None else None,
        "owned": staging is not None and not cache_dir,
        "seeding": fetching.seeding,  # None: not asked to seed
    }
    settings.FETCH.put(json.dumps(started))
    return started


def seeding_of(started: dict[str, Any]) -> str | None:
    """Where the fetch `ahead` started seeds: its URL while it runs on this host ("" where it could not seed);
    None where it was not asked to, runs elsewhere or has ended (its node seeds itself, if it may)."""
    url = started.get("seeding")
    if url is None or started.get("host") != socket.gethostname():
        return None
    return url if not url or Prefetch(int(started["pid"]), Path(started["done"])).running() else None


SEED_START = 30.0  # seconds a fetch has to bind its seeder (a token file on a hung mount must not hang a start)


def _line_within(stream: Any, seconds: float) -> str:
    """The next line of the unbuffered pipe `stream` ("" at its end), or why not, within `seconds`."""
    import select

    deadline, got = time.monotonic() + seconds, b""
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            return f"! it had not bound its seeder within {seconds:g} s"
        byte = stream.read(1)
        if not byte:
            break
        got += byte
    return got.decode(errors="replace").strip()


def stop_seeding(started: dict[str, Any]) -> None:
    """End the fetch `ahead` started (on this host) and the seeding it does: its owner's copies are to be
    served no more (an engine's model freed)."""
    if started.get("host") == socket.gethostname():
        Prefetch(int(started["pid"]), Path(started["done"])).stop()


def adopt(source: str) -> dict[str, Any] | None:
    """The fetch of `source` this process's environment names (`ahead`), if it runs on this host,
    taken out of the environment (an engine adopts it once: a later one loads on its own); else None
    (another source: the caller fetches its own)."""
    try:
        started = json.loads(settings.FETCH.get() or "")
    except ValueError:
        return None
    here = isinstance(started, dict) and started.get("host") == socket.gethostname()
    if not here or not _same_source(str(started.get("source", "")), source):
        return None
    settings.FETCH.clear()
    return started


STAGING = "streamload-prefetch-"  # a fetch's working directory in the temporary directory (base/leftovers.py)
COMPILE_CACHE = "streamload-compile-cache"  # beside the weights (`streamload compile-cache publish`)
MODEL_INFOS = f"{COMPILE_CACHE}/modelinfos.tar"
STAGED_INDEX = "ready.json"  # in the folder `stage_compile_caches` fills: written last


def stage_compile_caches(source: str, into: Path, pinned: frozenset[str]) -> list[str]:
    """The compiled-artifact archives published beside `source` that may be this node's, fetched into
    `into` before the weights (fetched when the worker installs one, they would wait behind the
    weights' download). The worker picks this node's (its key needs torch); here the key's factors that
    need no torch pick candidates, and only those of a `pinned` digest are kept (the worker checks
    again). `into/ready.json`, written last, lists what was published and what was fetched."""
    from streamload.integrations.startup.pinned_digests import digest
    from streamload.storage import is_hex, storage_for

    storage = storage_for(source)
    raw = storage.sidecar(beside(source), f"{COMPILE_CACHE}/index.json")
    published = json.loads(raw) if raw else {}
    here = _node_without_torch()
    into.mkdir(parents=True, exist_ok=True)
    fetched = []
    for name, key in sorted(published.items()):
        if not is_hex(name) or any(key.get(factor) != value for factor, value in here.items() if value):
            continue
        data = storage.sidecar(beside(source), f"{COMPILE_CACHE}/{name}.tar")
        if data is not None and digest(data) in pinned:
            with contextlib.suppress(OSError):  # not staged (a full disk): the worker fetches it itself
                atomic.write(into / f"{name}.tar", data)
                fetched.append(name)
    atomic.write(into / STAGED_INDEX, json.dumps({"published": published, "fetched": fetched}).encode())
    return fetched


def staged_compile_caches(started: dict[str, Any], timeout: float = 30) -> Path | None:
    """Where the fetch `started` (`ahead`) staged the compiled-artifact archives, once it has (it does
    so before the weights), or None: not staged on this host, or the fetch ended or took `timeout` s."""
    folder = started.get("compiled")
    if not folder or started.get("host") != socket.gethostname():
        return None
    ready, deadline = Path(folder) / STAGED_INDEX, time.monotonic() + timeout
    while not ready.exists():
        if Path(started["done"]).exists() or not _alive(int(started["pid"])) or time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return Path(folder)


def _node_without_torch() -> dict[str, str]:
    """The factors of `integrations.vllm.startup.compiled.node_key` known without importing torch or vLLM (the
    versions as their `__version__`, read from the packages' version files; "" where not found)."""
    import platform

    return {"vllm": _version_in("vllm", "_version.py"), "torch": _version_in("torch", "version.py"),
            "python": "{}.{}".format(*sys.version_info[:2]), "machine": platform.machine()}  # fmt: skip


def _version_in(package: str, file: str) -> str:
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
        text = Path(spec.origin).with_name(file).read_text() if spec and spec.origin else ""
    except (ImportError, OSError, ValueError):
        return ""
    found = re.search(r"^__version__ = (?:version = )?['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else ""


def install_model_infos(source: str) -> int:
    """vLLM's cached inspections of model classes published beside `source`, put into its cache root
    (`VLLM_CACHE_ROOT/modelinfos`) where absent, each whole; how many. vLLM inspects a model's class in
    a subprocess before any load format runs (15 s here) unless its cache holds the answer: so this runs
    in the fetch started first. They are data, but the archive is not pinned and what is installed is
    trusted by every later engine on the node: so only inspections of the classes this checkpoint's
    config.json names in `architectures` install (`_own_inspection`), read member by member as data,
    never unpacked (`_model_infos`), into a folder opened without following a link. Anything else is
    skipped with one warning; a bad archive installs nothing, never failing the load."""
    from streamload.storage import storage_for

    storage = storage_for(source)
    data = storage.sidecar(beside(source), MODEL_INFOS)
    if data is None:
        return 0
    what = f"{MODEL_INFOS} beside {redacted(source)}"
    infos = _model_infos(data, what, _architectures(storage, source))
    if not infos:
        return 0
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT") or os.path.join(home, "vllm")))
    try:
        folder = atomic.folder(root, "modelinfos")  # a link there (a shared cache's) is not written through
    except OSError as exc:
        log.warning("streamload: %s not installed: %s: %s", what, root / "modelinfos", exc)
        return 0
    try:
        return sum(atomic.write(Path(name), raw, dir_fd=folder, replace=False) for name, raw in infos.items())
    finally:
        os.close(folder)


_MODEL_INFO_MEMBER = re.compile(r"modelinfos/([A-Za-z0-9_-]+\.json)")
_MODEL_INFO_SIZE = 1 << 16  # bytes of one inspection at most (vLLM's are about 1 KiB)
_MODEL_INFOS_MEMBERS = 256  # members of an archive read at most: those after are skipped
_MODEL_INFOS_TOTAL = 4 << 20  # bytes of inspections read from an archive at most


def _architectures(storage: Any, source: str) -> frozenset[str]:
    """The model classes the config.json beside `source` names in `architectures`, read through
    `storage`; none where there is no such config, or it cannot be read or names no list."""
    try:
        raw = storage.sidecar(beside(source), "config.json")
        config = json.loads(raw) if raw is not None else None
    except ValueError:  # unreadable (a SourceError), not JSON, not UTF-8
        return frozenset()
    names = config.get("architectures") if isinstance(config, dict) else None
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()


def _model_infos(data: bytes, what: str, classes: frozenset[str]) -> dict[str, bytes]:
    """File name -> bytes of each regular file `modelinfos/<module>-<Class>.json` in the tar `data` (`what`
    in warnings) that `_own_inspection` accepts, read within the caps above; the rest skipped, with one
    warning. An archive that is not an uncompressed tar gives none (no gzip bomb is inflated)."""
    import io
    import tarfile

    infos: dict[str, bytes] = {}
    skipped = total = 0
    capped = False
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for count, member in enumerate(tar):  # one header at a time
                if count == _MODEL_INFOS_MEMBERS:
                    capped = True
                    break
                found = _MODEL_INFO_MEMBER.fullmatch(member.name)
                name = found.group(1) if found else ""
                source = tar.extractfile(member) if member.isreg() and name and name not in infos else None
                size = min(member.size, _MODEL_INFO_SIZE + 1)
                raw = source.read(size) if source is not None and total + size <= _MODEL_INFOS_TOTAL else b""
                total += len(raw)
                if len(raw) <= _MODEL_INFO_SIZE and _own_inspection(name, raw, classes):
                    infos[name] = raw
                else:
                    skipped += 1
    except (tarfile.TarError, EOFError, OSError) as exc:
        log.warning("streamload: %s is not an uncompressed tar archive (%s): nothing of it installed", what, exc)
        return {}
    if skipped or capped:
        after = f" and those after the first {_MODEL_INFOS_MEMBERS}" if capped else ""
        named = ", ".join(sorted(classes)) or "none: no config.json beside it names them"
        log.warning(
            "streamload: %s: %d member(s)%s skipped: only files modelinfos/<module>-<Class>.json holding vLLM's "
            "inspection of that class (at most %d bytes), for a class the checkpoint's config.json names in "
            "`architectures` (%s), are installed", what, skipped, after, _MODEL_INFO_SIZE, named
        )  # fmt: skip
    return infos


def _own_inspection(name: str, raw: bytes, classes: frozenset[str]) -> bool:
    """Whether `raw` is shaped as vLLM writes a model inspection (`{"hash": str, "modelinfo": {name: a
    JSON scalar or a list of strings}}`), and, in the file `name` (vLLM names it `<module>-<Class>.json`,
    the module's dots as dashes: a class name holds neither), is of a class in `classes` and says it is
    of that class: vLLM reads the file for that class, whatever it says inside."""
    try:
        info = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(info, dict) or set(info) != {"hash", "modelinfo"} or not isinstance(info["hash"], str):
        return False
    fields, named = info["modelinfo"], name.removesuffix(".json").rpartition("-")[2]
    if not isinstance(fields, dict) or named not in classes or fields.get("architecture") != named:
        return False
    plain = (bool, int, float, str, type(None))
    return all(
        isinstance(v, plain) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in fields.values()
    )


def beside(source: str) -> Path | Any:
    """A path next to which files published beside the weights sit (storages' `sidecar` takes its parent)."""
    if "://" in source:
        from streamload.storage.remote import ObjectPath

        return ObjectPath(source if source.endswith((".safetensors", ".json")) else source.rstrip("/") + "/config.json")
    path = Path(source)
    return path if path.is_file() else path / "config.json"


def _same_source(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def wait(done: Path, pid: int, timeout: float | None = None) -> dict[str, object]:
    """Block until the prefetch of process `pid` reports in `done` (its report), it ends without one,
    or `timeout` seconds pass (then `{"ok": False, ...}`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ended = not _alive(pid)  # before the report is read: one written just before the end is still read
        try:
            return dict(json.loads(done.read_text()))
        except (OSError, ValueError):
            if ended:
                return {"ok": False, "error": f"the prefetch (process {pid}) ended without a report"}
        if deadline is not None and time.monotonic() > deadline:
            return {"ok": False, "error": f"the prefetch did not finish within {timeout:g} s"}
        time.sleep(0.02)


def _is_prefetch(pid: int, done: Path | None = None) -> bool:
    """Whether process `pid` is a prefetch (the one reporting to `done`, where given: a fetch that ended long
    ago may have left its id to another one)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return MODULE.encode() in argv and (done is None or str(done).encode() in argv)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (not ended, nor a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return leftovers.started(pid) is not None or not os.path.isdir("/proc")  # without /proc: taken as running


FETCH_BYTES = 8 << 20  # one read of an object's bytes (the store's pace cuts it into its own requests)


def fetch(
    source: str,
    cache_dir: Path | None = None,
    budget: int | None = None,
    threads: int | None = None,
    peers: str | Sequence[str] | None = None,
) -> dict[str, object]:
    """Read `source` once, keeping nothing (the page cache, or `cache_dir` for object storage, keeps
    the bytes); the report `wait` returns. Objects are read file after file (each complete, and usable
    by a load waiting for it, as early as it can be), by as many reads at once as a load makes.
    `peers`: nodes seeding the objects, read from first."""
    if "://" not in source:
        return _fetch_local(Path(source), budget)
    from concurrent.futures import ThreadPoolExecutor

    from streamload.plan.checkpoint import open_checkpoint
    from streamload.storage.cache import cache_path, kept
    from streamload.storage.peers import TALLY, with_peers

    checkpoint = open_checkpoint(source, cache_dir)
    headers = checkpoint.files
    if checkpoint.storage.local:  # every file is in the cache already
        cached, size = [str(h.path) for h in headers], sum(h.size for h in headers)
        return {"ok": True, "bytes": 0, "cached": cached, "cached_bytes": size, "not_cached": []}
    if budget is None and cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        budget = shutil.disk_usage(cache_dir).free
    if budget is not None and checkpoint.nbytes > budget:
        return _over(checkpoint.nbytes, budget)
    files = with_peers(checkpoint.storage, peers).open({h.path: h for h in headers})
    reads = [(h.path, at, min(FETCH_BYTES, h.size - at)) for h in headers
             for at in range(h.data_start, h.size, FETCH_BYTES)]  # fmt: skip
    pool = ThreadPoolExecutor(threads or reader_threads(), thread_name_prefix="streamload-fetch")
    try:
        got = sum(sum(len(v) for v in views) for views in pool.map(lambda r: files.read(*r), reads))
    except BaseException:
        files.cancel()  # the reads in flight end at once
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        files.close()
    report: dict[str, object] = {"ok": True, "bytes": got}
    if peers:  # (this process's tally: the fetch is all it reads)
        report["from_peers"], report["from_source"] = TALLY.read()
    if cache_dir is not None:  # an object read but not kept was warned of (a full disk, a link, a writer still at it)
        whole = {h.path for h in kept(Path(cache_dir), headers)}
        report["cached"] = [str(cache_path(Path(cache_dir), h.path)) for h in headers if h.path in whole]
        report["cached_bytes"] = sum(h.size for h in headers if h.path in whole)
        report["not_cached"] = [str(h.path) for h in headers if h.path not in whole]
    return report


def _fetch_local(source: Path, budget: int | None) -> dict[str, object]:
    """The files a load of `source` reads (its index's, else every *.safetensors) into the page cache."""
    from streamload.storage.base import INDEX_NAME, parse_index

    index = source / INDEX_NAME if source.is_dir() else source
    if source.is_dir() and not index.is_file():
        files = sorted(source.glob("*.safetensors"))
    elif index.name.endswith(".index.json"):
        files = [Path(f) for f in parse_index(index, index.read_text("utf-8")).files]
    else:
        files = [source]
    size = sum(f.stat().st_size for f in files)
    if budget is None:
        budget = (available_memory() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) // 2
    if size > budget:
        return _over(size, budget)
    for file in files:
        with open(file, "rb") as f:
            _into_page_cache(f.fileno(), os.fstat(f.fileno()).st_size)
    return {"ok": True, "bytes": size}


_MADV_POPULATE_READ = 22  # Linux >= 5.14
_STEP = 64 << 20


def _into_page_cache(fd: int, size: int) -> None:
    """Every page of the file read into the page cache: mapped with MADV_POPULATE_READ (what is
    cached already costs a page-table entry, nothing is copied), else read through a buffer.
    (POSIX_FADV_WILLNEED alone is advice: measured, it brought in 3% of a 156 MB file.)"""
    if size == 0:
        return
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        try:
            for start in range(0, size, _STEP):
                mapped.madvise(_MADV_POPULATE_READ, start, min(_STEP, size - start))
            return
        except (OSError, ValueError):  # an older kernel
            pass
    buffer = bytearray(8 << 20)
    os.lseek(fd, 0, os.SEEK_SET)
    while os.readv(fd, [buffer]):
        pass


def _over(size: int, budget: int) -> dict[str, object]:
    return {"ok": False, "error": f"{size} bytes do not fit the prefetch's budget of {budget} bytes"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("--done", type=Path, required=True, help="the report (JSON) written when it ends")
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--budget", type=int)
    parser.add_argument("--threads", type=int, help="reads at once from object storage (default: as a load)")
    parser.add_argument("--model-infos", action="store_true", help="first install vLLM's model inspections "
                        "published beside the weights (install_model_infos)")  # fmt: skip
    parser.add_argument("--compile-caches", type=Path, help="first fetch the compiled-artifact archives "
                        "published beside the weights that may be this node's into this folder")  # fmt: skip
    parser.add_argument("--pin", action="append", default=[], help="a digest of a compiled-artifact archive "
                        "to fetch (sha256:HEX; pinned_digests.py): others are not kept")  # fmt: skip
    parser.add_argument("--peers", action="append", default=[], help="a node seeding the objects (a URL, or a "
                        "name whose addresses are the nodes; repeat for several): read from first")  # fmt: skip
    parser.add_argument("--seed", type=json.loads, help="serve --cache-dir to other nodes' peers= from the "
                        "start, and on once fetched: the Seeder's arguments (JSON); its URL is printed")  # fmt: skip
    parser.add_argument("--watch", type=int, help="end when the process of this id ends (`start`)")
    parser.add_argument("--work", type=Path, help="the folder the watched process made for this fetch "
                        "(leftovers.make): removed when it ends")  # fmt: skip
    args = parser.parse_args(argv)
    if args.watch is not None:  # started by `start`: detach (the starter exits at once) and watch it
        child = os.fork()
        if child:
            print(child, flush=True)
            os._exit(0)
        threading.Thread(target=_end_with, args=(args.watch, args.work), daemon=True).start()
    seeding = _seed(args.cache_dir, args.seed) if args.seed is not None else None
    if args.model_infos:
        with contextlib.suppress(Exception):  # an optimisation only: vLLM inspects the model itself
            install_model_infos(args.source)
    if args.compile_caches is not None:
        with contextlib.suppress(Exception):  # an optimisation only: the worker fetches its archive itself
            stage_compile_caches(args.source, args.compile_caches, frozenset(args.pin))
    # its warnings (a peer dropped...) go with its report too: an engine's fetch has no stderr of its own
    said = _Said()
    logging.getLogger("streamload").addHandler(said)
    logging.getLogger("streamload").addHandler(logging.lastResort or logging.StreamHandler())  # (as without one)
    try:
        report = fetch(args.source, args.cache_dir, args.budget, args.threads, args.peers)
    except Exception as exc:  # reported, not raised: the load that follows goes on without it
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["warnings"] = said.lines
    atomic.write(args.done, json.dumps(report).encode())
    if seeding is not None:  # serves on until stopped, or the process it watches ends
        threading.Event().wait()
    return 0 if report["ok"] else 1


class _Said(logging.Handler):
    """The first `SAID` warnings of this process, as their lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < SAID:
            self.lines.append(record.getMessage())


SAID = 50  # warnings a fetch's report carries at most


def _seed(cache_dir: Path | None, options: dict[str, Any]) -> Any:
    """The seeder of `cache_dir` started (None where it cannot be), its URL (or "! why") the line printed:
    `start` reads it. Serving starts before the fetch, so that other nodes find this one loading at once."""
    from streamload.servers.seed import Seeder

    seeder, said = None, "! no cache directory"
    if cache_dir is not None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            seeder = Seeder(cache_dir, **options).start()
            said = seeder.url
        except (OSError, TypeError, ValueError) as exc:
            said = f"! {(exc.strerror if isinstance(exc, OSError) else None) or exc}"
    with contextlib.suppress(OSError):  # the reader gave up (`SEED_START`): it serves all the same
        print(said, flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the pipe `start` reads ends here: nothing more is said on it
    os.dup2(devnull, 1)
    os.close(devnull)
    return seeder


def _end_with(pid: int, work: Path | None = None) -> None:
    """This process ends when process `pid` does: a server stopped mid-start-up leaves no fetch; nor
    `work`, the folder `pid` made for the fetch (`ahead`), had `pid` ended without its exit handlers
    (SIGKILL, OOM): `leftovers.remove` removes it only where its record names `pid` as its maker. (A
    user's `cache_dir` is not in it: what was fetched there is kept.)"""
    while _alive(pid):
        time.sleep(0.2)
    if work is not None:
        leftovers.remove(work, pid)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())  # requests still in flight are dropped at exit (storage/remote.py: _wind_down)
