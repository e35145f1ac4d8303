"""A cache directory filled and read by several processes at once (`storage/cache.py`): real processes
(`python -m streamload.integrations.startup.prefetch`, as servers start it), a store capped per connection, SIGKILL at
several points of a write. Every copy that looks complete is the store's file byte for byte, and every
later load is bit-exact."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.storage import cache as cache_module
from streamload.storage.cache import cache_path
from streamload.storage.remote import ObjectPath

from .cli_runs import cli
from .conftest import Mount, random_tensor, same_bits, start_ranks
from .servers import RangeServer

pytest.importorskip("obstore")
RATE = 2 << 20  # bytes a second per connection: a fetch of the checkpoint takes about a second
DEADLINE = 60.0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_shards(tmp_path_factory.mktemp("store"))


def two_shards(root: Path) -> Path:
    """Two shards of 2 MB (each layer's tensors in one shard) in `root/model/`, to be served from `root`."""
    model = root / "model"
    model.mkdir()
    index: dict[str, str] = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {
            f"model.layers.{layer}.{w}": random_tensor(torch.bfloat16, (256, 1024), seed=10 * layer + k)
            for layer in range(4 * (shard - 1), 4 * shard)
            for k, w in enumerate(("up.weight", "down.weight"))
        }
        save_file(tensors, model / name)
        index.update(dict.fromkeys(tensors, name))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return root


@pytest.fixture
def server(store: Path) -> Iterator[RangeServer]:
    s = RangeServer(store, rate=RATE)
    yield s
    s.close()


def data_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in (store / "model").glob("*.safetensors"))


def reference(store: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted((store / "model").glob("*.safetensors")) for n, t in load_file(f).items()}


def prefetch(url: str, cache: Path, done: Path) -> subprocess.Popen[bytes]:
    """`python -m streamload.integrations.startup.prefetch`, reporting into `done` (kept as the process's `done`)."""
    cmd = [
        sys.executable,
        "-m",
        "streamload.integrations.startup.prefetch",
        url,
        "--done",
        str(done),
        "--cache-dir",
        str(cache),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.done = done  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 0, err.decode()
    return json.loads(proc.done.read_text())  # type: ignore[attr-defined]


def wait_until(what: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not what():
        if proc.poll() is not None:
            assert what(), f"the fetch ended first: {proc.stderr.read().decode() if proc.stderr else ''}"
            return
        assert time.monotonic() < deadline
        time.sleep(0.005)


def copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.name.endswith(".safetensors"))


def assert_cache_holds_only_whole_copies(cache: Path, store: Path) -> None:
    """Whatever has a copy's name is the store's file, byte for byte; nothing else is left but locks
    and the partial files of writers that were killed (never under a copy's name)."""
    for copy in copies(cache):
        assert copy.read_bytes() == (store / "model" / copy.name).read_bytes(), copy
    for p in cache.rglob("*"):
        assert (
            p.is_dir()
            or p.name.endswith((".safetensors", ".streamload.json", ".lock", ".json"))
            or ".partial." in p.name
        )


def assert_later_loads_exact(url: str, cache: Path, store: Path) -> None:
    ref = reference(store)
    for _ in range(2):  # the first may still complete the copies, the second reads them
        got = streamload.load(url, device="cpu", cache_dir=cache)
        assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    with streamload.iter(url, device="cpu", cache_dir=cache) as stream:
        assert stream.stats.reader == "mmap"  # complete and local now
        got = dict(stream)
    assert all(same_bits(got[n], ref[n]) for n in ref)
    assert_cache_holds_only_whole_copies(cache, store)
    assert sorted(cache.rglob("*.lock")) == []  # each removed by the process that held it last


def start_two(url: str, cache: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Two fetches started at once (as servers on one node are): (the writer, the one that waits for it),
    told apart by the writer's partial files, which carry its process id."""
    both = [prefetch(url, cache, tmp_path / f"{i}.json") for i in range(2)]
    partials = lambda: [p.name for p in cache.rglob("*.partial.*")]  # noqa: E731
    wait_until(lambda: bool(partials()), both[0])
    pid = int(partials()[0].split(".partial.", 1)[1].split(".")[-2])
    writer = next(p for p in both if p.pid == pid)
    return writer, next(p for p in both if p is not writer)


def test_two_fetches_into_one_cache_download_once(server: RangeServer, store: Path, tmp_path: Path) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    both = start_two(url, cache, tmp_path)
    assert all(finish(p)["ok"] is True for p in both)
    assert len(copies(cache)) == 2
    assert server.sent <= 1.05 * data_bytes(store)  # the second read the first's copies, not the store
    assert_later_loads_exact(url, cache, store)


@pytest.mark.parametrize(
    ("killed", "point"), [("writer", "10%"), ("writer", "first-copy"), ("writer", "80%"), ("waiter", "50%")]
)
def test_a_fetch_killed_at_any_point_leaves_nothing_that_looks_complete(
    server: RangeServer, store: Path, tmp_path: Path, killed: str, point: str
) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    total = data_bytes(store)
    writer, waiter = start_two(url, cache, tmp_path)
    victim, survivor = (writer, waiter) if killed == "writer" else (waiter, writer)
    if point == "first-copy":
        wait_until(lambda: len(copies(cache)) >= 1, writer)
    else:
        wait_until(lambda: server.sent >= float(point[:-1]) / 100 * total, writer)
    assert writer.poll() is None, "the writer ended before the point"
    victim.send_signal(signal.SIGKILL)
    victim.wait(DEADLINE)
    assert victim.returncode == -signal.SIGKILL
    got = finish(survivor)
    assert got["ok"] is True, got
    assert_cache_holds_only_whole_copies(cache, store)
    assert_later_loads_exact(url, cache, store)


def test_a_load_reads_while_a_fetch_writes(server: RangeServer, store: Path, tmp_path: Path) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    ref = reference(store)
    writer = prefetch(url, cache, tmp_path / "a.json")
    wait_until(lambda: server.sent > 0, writer)
    got = streamload.load(url, device="cpu", cache_dir=cache)  # waits for the copies as it needs them
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    assert finish(writer)["ok"] is True
    assert server.sent <= 1.05 * data_bytes(store)
    assert_later_loads_exact(url, cache, store)


def test_the_old_shared_partial_is_cleaned_and_never_taken_for_a_copy(
    server: RangeServer, store: Path, tmp_path: Path
) -> None:
    """A killed writer's partial file, and a copy under a record of another inode (a file put there by
    hand, or by an older writer): neither counts as complete; the next writer replaces both."""
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    streamload.load(url, device="cpu", cache_dir=cache)
    first = copies(cache)[0]
    stale = Path(f"{first}.partial.otherhost.1.abcd")
    stale.write_bytes(b"\0" * 1000)
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.unlink()
    first.write_bytes(bytes(data))  # the same size under the old record: another inode
    with streamload.iter(url, device="cpu", cache_dir=cache) as stream:
        assert stream.stats.reader == "range"
        got = dict(stream)
    ref = reference(store)
    assert all(same_bits(got[n], ref[n]) for n in ref)
    assert not stale.exists()
    assert_later_loads_exact(url, cache, store)


def test_no_lock_or_descriptor_outlives_a_load(server: RangeServer, store: Path, tmp_path: Path) -> None:
    url, cache = f"{server.url}/model/", tmp_path / "cache"

    def open_in_cache() -> list[str]:
        fds = Path("/proc/self/fd")
        return [t for t in (os.path.realpath(fds / fd) for fd in os.listdir(fds)) if t.startswith(str(cache))]

    streamload.load(url, device="cpu", cache_dir=cache, include="model.layers.0.*")  # reads shard 1 in part
    assert not open_in_cache() and not cache_module._held
    assert not copies(cache)  # shard 1 read in part is not kept (shard 2 was not read)
    streamload.load(url, device="cpu", cache_dir=cache)
    streamload.load(url, device="cpu", cache_dir=cache)
    assert not open_in_cache() and not cache_module._held


# -- a cache shared across users, hosts and full disks ------------------------------------------------
SECOND_USER = 65534  # nobody: a user of its own, umask 022, who owns nothing in the cache
LOAD_AND_HASH = """\
import hashlib, json, os, sys
import torch
import streamload
from streamload.storage import cache
if sys.argv[3] != "-":
    cache.WRITER_STALL = float(sys.argv[3])
if sys.argv[4] != "-":  # the interpreter is root's (under /root): started as root, the load runs as the user
    streamload.inspect(sys.argv[1])  # imports what reading an object takes (headers only)
    uid = int(sys.argv[4])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.umask(0o022)
got = streamload.load(sys.argv[1], device="cpu", cache_dir=sys.argv[2])
raw = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in got.items()}
print(json.dumps({n: hashlib.sha256(b).hexdigest() for n, b in raw.items()}))
"""


def hashes(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in tensors.items()
    }


def load_elsewhere(url: str, cache: Path, stall: float | None = None, user: int | None = None) -> tuple[dict, str]:
    """A load in a process of its own (as `user`, umask 022; with WRITER_STALL `stall`): the tensors'
    hashes, and its stderr."""
    cmd = [
        sys.executable,
        "-c",
        LOAD_AND_HASH,
        url,
        str(cache),
        *(str(x) if x is not None else "-" for x in (stall, user)),
    ]
    env = {**os.environ, "HOME": str(cache.parent)}
    done = subprocess.run(cmd, capture_output=True, timeout=DEADLINE / 2, cwd=Path(__file__).parents[1], env=env)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout), done.stderr.decode()


def not_kept(text: str) -> list[str]:
    return [line for line in text.splitlines() if "cannot keep copies there" in line]


def partials(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if ".partial." in p.name]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's own are its user's only)."""
    path = Path(tempfile.mkdtemp(prefix="streamload-shared-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a load as a second user: needs root")
def test_a_second_user_loads_from_the_cache_the_first_filled(
    server: RangeServer, store: Path, shared_dir: Path
) -> None:
    """The first user's lock files are 0644 (umask 022): the second opens them read-only and reads the first's
    copies, checked against the origin's digest file (bound to the objects' versions); where the cache lacks a
    copy, the second user's load reads from the store, and neither reads the first's other copy unchecked
    there (the cache's root is everyone's, as /tmp is, but the folders under it are the first user's)."""
    from streamload.integrity.digests import DIGEST_FILE
    from streamload.pipeline.verify import write_digests

    url, cache = f"{server.url}/model/", shared_dir / "cache"
    write_digests(streamload.inspect(url), out=store / "model" / DIGEST_FILE)
    cache.mkdir()
    cache.chmod(0o1777)
    umask = os.umask(0o022)
    try:
        streamload.load(url, device="cpu", cache_dir=cache)
    finally:
        os.umask(umask)
    sent = server.sent
    got, err = load_elsewhere(url, cache, user=SECOND_USER)
    assert got == hashes(reference(store))
    assert server.sent - sent < 1 << 20, err  # headers and the digest file: every tensor from the copies
    kept, gone = copies(cache)
    gone.unlink()  # a newer version, or a copy the first user's load did not finish
    Path(f"{gone}{cache_module.RECORD}").unlink()
    sent = server.sent
    got, err = load_elsewhere(url, cache, user=SECOND_USER)
    assert got == hashes(reference(store))
    assert server.sent - sent >= (store / "model" / gone.name).stat().st_size  # read from the store
    assert len(not_kept(err)) == 1 and str(cache) in not_kept(err)[0], err
    assert copies(cache) == [kept] and not partials(cache)


# -- links another user of a shared cache put there ---------------------------------------------------
FIRST = "model-00001-of-00002.safetensors"
SECOND = "model-00002-of-00002.safetensors"
FOLDERS = {"scheme": 3, "host": 2, "key folder 1": 1, "key folder 2": 0}  # first copy's ancestor: the folder's level
FILES = {"file": "", "record": cache_module.RECORD, "lock": cache_module.LOCK}


@pytest.fixture
def nested(store: Path) -> Iterator[tuple[RangeServer, str]]:
    """The store served from its parent, at full speed: two key folders (`<store>/model/`) under the host's."""
    s = RangeServer(store.parent)
    yield s, f"{s.url}/{store.name}/model/"
    s.close()


def open_under(*roots: Path) -> list[str]:
    """What this process has open under `roots` (their links not followed: the paths as the kernel names them)."""
    fds = Path("/proc/self/fd")
    opened = (os.path.realpath(fds / fd) for fd in os.listdir(fds))
    return [t for t in opened if any(t == str(r) or t.startswith(f"{r}/") for r in roots)]


def warnings_naming(caplog: pytest.LogCaptureFixture, what: Path) -> tuple[list[str], list[str]]:
    """(every warning of the "streamload" logger, those that name `what`)."""
    every = [r.getMessage() for r in caplog.records if r.name == "streamload" and r.levelno >= logging.WARNING]
    return every, [m for m in every if str(what) in m]


def ranged_bytes(requests: list[tuple[str, str, str | None]]) -> int:
    """The bytes the GET requests asked for (`bytes=a-b`)."""
    spans = [re.fullmatch(r"bytes=(\d+)-(\d+)", r or "") for m, _, r in requests if m == "GET"]
    return sum(int(s[2]) + 1 - int(s[1]) for s in spans if s)


def plant(cache: Path, url: str, level: str, outside: Path) -> Path:
    """A link where `level` of the first shard's copy goes (one of its folders, the copy, its record or its
    lock), to `outside`: an empty folder, or a file with bytes of its own. The link."""
    first = cache_path(cache, ObjectPath(f"{url}{FIRST}"))
    link = first.parents[FOLDERS[level]] if level in FOLDERS else Path(f"{first}{FILES[level]}")
    link.parent.mkdir(parents=True, exist_ok=True)
    if level in FOLDERS:
        outside.mkdir()
    else:
        outside.write_bytes(b"another user's file, not the cache's")
    link.symlink_to(outside, target_is_directory=level in FOLDERS)
    return link


@pytest.mark.parametrize("level", [*FOLDERS, *FILES])
def test_a_link_planted_in_a_shared_cache_is_never_followed(
    nested: tuple[RangeServer, str], store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    """Another user of the cache (its root is everyone's, 1777) plants a link where a folder, a copy, its
    record or its lock goes: the load writes nothing through it (the link's target keeps what it had),
    reads the objects behind it from the store, bit-exact, keeps the copies no link is in the way of, and
    one warning names the link."""
    _, url = nested
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    cache.chmod(0o1777)
    link = plant(cache, url, level, outside)
    before = None if outside.is_dir() else (outside.read_bytes(), outside.stat().st_mtime_ns)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        got = streamload.load(url, device="cpu", cache_dir=cache)
    ref = reference(store)
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    if before is None:
        assert list(outside.iterdir()) == []
    else:
        assert (outside.read_bytes(), outside.stat().st_mtime_ns) == before
    assert link.is_symlink() and os.readlink(link) == str(outside)  # neither replaced nor removed
    every, named = warnings_naming(caplog, link)
    assert len(named) == 1 and len(every) == 1, every
    kept = [p.name for p in copies(cache) if not p.is_symlink()]
    assert kept == ([] if level in FOLDERS else [SECOND])
    assert not partials(cache) and not [p for p in cache.rglob("*.lock") if not p.is_symlink()]
    assert not open_under(cache, outside) and not cache_module._held


def test_complete_copies_behind_a_link_are_not_read(
    nested: tuple[RangeServer, str], store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder of whole copies (their records vouch for them) moved out of the cache and linked back in:
    what lies behind a link is no copy, so the load reads every object from the store, writes nothing
    there, and one warning names the link."""
    server, url = nested
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    streamload.load(url, device="cpu", cache_dir=cache)
    folder = cache_path(cache, ObjectPath(f"{url}{FIRST}")).parent
    folder.rename(outside)
    folder.symlink_to(outside, target_is_directory=True)
    there = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in outside.iterdir()}
    asked = len(server.requests)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        got = streamload.load(url, device="cpu", cache_dir=cache)
    ref = reference(store)
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    assert ranged_bytes(server.requests[asked:]) >= data_bytes(store)  # every object from the store
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in outside.iterdir()} == there
    every, named = warnings_naming(caplog, folder)
    assert len(named) == 1 and len(every) == 1, every
    assert not open_under(cache, outside)


def test_a_fetch_writes_nothing_through_a_link(nested: tuple[RangeServer, str], tmp_path: Path) -> None:
    """`python -m streamload.integrations.startup.prefetch` fills the cache through the same walk: a link for the
    scheme's folder leaves its target empty, the fetch succeeds, and its one warning names the link."""
    _, url = nested
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    link = plant(cache, url, "scheme", outside)
    fetch = prefetch(url, cache, tmp_path / "done.json")
    _, err = fetch.communicate(timeout=DEADLINE)
    assert fetch.returncode == 0, err.decode()
    assert json.loads((tmp_path / "done.json").read_text())["ok"] is True
    assert list(outside.iterdir()) == [] and link.is_symlink()
    assert len([line for line in err.decode().splitlines() if str(link) in line]) == 1, err.decode()


@pytest.mark.parametrize("level", [*FOLDERS, "file"])
def test_a_small_file_kept_under_a_cache_root_is_never_written_through_a_link(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    """`keep(..., root=cache_dir)` (a digest file, an index beside the copies) walks the folders as a load
    does: through a link it keeps nothing (one warning names the file), and the link's target keeps what it had."""
    url, cache, outside = "http://127.0.0.1:1/store/model/", tmp_path / "cache", tmp_path / "outside"
    plant(cache, url, level, outside)
    before = None if outside.is_dir() else (outside.read_bytes(), outside.stat().st_mtime_ns)
    local = cache_path(cache, ObjectPath(f"{url}{FIRST}"))
    with caplog.at_level(logging.WARNING, logger="streamload"):
        cache_module.keep(local, b"{}", root=cache)
    if before is None:
        assert list(outside.iterdir()) == []
        assert len(warnings_naming(caplog, local)[1]) == 1
    else:  # the link itself is replaced by the file, whole: its target is untouched
        assert (outside.read_bytes(), outside.stat().st_mtime_ns) == before and local.read_bytes() == b"{}"
    assert not partials(cache) and not open_under(cache, outside)


def test_a_cached_load_is_read_from_its_copies_the_next_time(
    nested: tuple[RangeServer, str], store: Path, tmp_path: Path
) -> None:
    """The walk keeps the cache working: the first load keeps both copies, the next reads them (nothing
    more from the store), and no descriptor or lock is left open after either."""
    server, url = nested
    cache = tmp_path / "cache"
    ref = reference(store)
    got = streamload.load(url, device="cpu", cache_dir=cache)
    assert all(same_bits(got[n], ref[n]) for n in ref)
    assert [p.name for p in copies(cache)] == [FIRST, SECOND] and not open_under(cache)
    assert_cache_holds_only_whole_copies(cache, store)
    sent = server.sent
    with streamload.iter(url, device="cpu", cache_dir=cache) as stream:
        assert stream.stats.reader == "mmap"  # local copies, found by `lookup`
        got = dict(stream)
    assert all(same_bits(got[n], ref[n]) for n in ref) and got.keys() == ref.keys()
    assert server.sent == sent and not open_under(cache) and not cache_module._held


@pytest.mark.parametrize("room", ["a copy and a half", "all but the last record"])
def test_a_full_disk_costs_the_copy_not_the_load(
    server: RangeServer, store: Path, mount: Mount, caplog: pytest.LogCaptureFixture, room: str
) -> None:
    """ENOSPC while a copy's bytes are written, or while its record is (`_complete`): the load goes on
    from the store, one warning names the cache, and nothing partial is left."""
    url = f"{server.url}/model/"
    sizes = [f.stat().st_size for f in sorted((store / "model").glob("*.safetensors"))]
    if room == "a copy and a half":
        size = sizes[0] + sizes[1] // 2
    else:  # what a whole load takes there, less a page: the last thing written, a record, does not fit
        roomy = mount(4 * sum(sizes))
        streamload.load(url, device="cpu", cache_dir=roomy / "cache")
        st = os.statvfs(roomy)
        size = (st.f_blocks - st.f_bfree - 1) * st.f_frsize
    cache = mount(size) / "cache"
    with caplog.at_level(logging.WARNING, logger="streamload"):
        got = streamload.load(url, device="cpu", cache_dir=cache)
    ref = reference(store)
    assert got.keys() == ref.keys() and all(same_bits(got[n], ref[n]) for n in ref)
    assert len(not_kept(caplog.text)) == 1 and str(cache) in caplog.text and "No space left" in caplog.text
    assert not partials(cache)
    assert len(copies(cache)) <= 1
    assert_cache_holds_only_whole_copies(cache, store)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Two tensors in one file behind an HTTP server with Range: its URL and the tensors."""
    folder = tmp_path / "served"
    folder.mkdir()
    tensors = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, folder / "model.safetensors")
    server = RangeServer(folder)
    try:
        yield f"{server.url}/", tensors
    finally:
        server.close()


def test_a_cache_dir_that_cannot_be_written_is_one_warning_naming_it_and_the_load_goes_on(
    served: tuple[str, dict[str, torch.Tensor]], tmp_path: Path, mount: Mount
) -> None:
    """A file where the cache folder goes, a folder under that file, a read-only folder and one to be made
    there: none ends the load, nor names a folder deep inside the cache; one warning names the cache_dir."""
    url, _ = served
    a_file = tmp_path / "cache-file"
    a_file.write_text("")
    read_only = mount(read_only=True)
    for cache in (a_file, a_file / "sub", read_only, read_only / "sub"):
        run = cli("load", url, "--device", "cpu", "--cache-dir", str(cache), timeout=120)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        warned = [line for line in run.stderr.splitlines() if "cannot keep copies there" in line]
        assert len(warned) == 1 and warned[0].startswith(f"streamload: cache_dir {cache}: "), run.stderr
        assert "reads from the store without keeping them" in warned[0]
        assert run.stdout.splitlines()[-1].startswith("2 tensors, "), run.stdout
    assert a_file.read_text() == "" and list(read_only.iterdir()) == []


def test_a_read_only_cache_that_holds_the_checkpoint_is_still_read(
    served: tuple[str, dict[str, torch.Tensor]], mount: Mount
) -> None:
    url, tensors = served
    cache = mount(fill=lambda point: streamload.load(url, device="cpu", cache_dir=point), read_only=True)
    got = streamload.load(url, device="cpu", cache_dir=cache)  # nothing to write there: it is only read
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_a_copy_reserves_its_whole_size_before_its_bytes_arrive(store: Path, tmp_path: Path, mount: Mount) -> None:
    """Disk is reserved for what is being fetched, not checked once: a writer stopped mid-copy already
    holds its file's every block, so another writer or a later copy cannot take the space it needs
    (on a full disk the copy fails at its start, and the load goes on without it: above)."""
    server = RangeServer(store, rate=RATE / 4)
    url = f"{server.url}/model/"
    sizes = {f.name: f.stat().st_size for f in (store / "model").glob("*.safetensors")}
    cache = mount(4 * sum(sizes.values())) / "cache"
    writer = prefetch(url, cache, tmp_path / "writer.json")
    try:
        wait_until(lambda: server.sent > 0 and bool(partials(cache)), writer)
        writer.send_signal(signal.SIGSTOP)
        assert server.sent < sum(sizes.values())  # mid-copy
        for partial in partials(cache):
            assert partial.stat().st_blocks * 512 >= sizes[partial.name.split(".partial.")[0]]  # every block taken
    finally:
        writer.kill()
        writer.wait(DEADLINE)
        server.close()


def test_a_stopped_writer_is_given_up_on(store: Path, tmp_path: Path) -> None:
    """A writer stopped mid-copy (SIGSTOP: alive, holding its locks): a load waiting for it reads from the
    store once the writer's partial file has not changed for WRITER_STALL seconds, and warns once."""
    server = RangeServer(store, rate=RATE / 4)  # the writer is stopped mid-copy
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    writer = prefetch(url, cache, tmp_path / "writer.json")
    try:
        wait_until(lambda: server.sent > 0 and bool(partials(cache)), writer)
        writer.send_signal(signal.SIGSTOP)
        got, err = load_elsewhere(url, cache, stall=1.0)  # within its timeout (a wait for ever would not end)
        writer.kill()
        writer.wait(DEADLINE)
        assert got == hashes(reference(store))
        stalled = [line for line in err.splitlines() if "wrote nothing for 1 s" in line]
        assert len(stalled) == 1 and str(cache) in stalled[0], err
        assert_later_loads_exact(url, cache, store)  # the stopped writer's partial files go with the next writer
    finally:
        writer.kill()
        writer.wait(DEADLINE)
        server.close()


NFS_MOUNTINFO = r"""22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw,discard,errors=remount-ro
311 22 0:55 / /mnt/models rw,relatime shared:171 - nfs 10.0.0.5:/export/models rw,vers=3,rsize=1048576,wsize=1048576,namlen=255,hard,nolock,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=10.0.0.5,mountvers=3,mountport=20048,mountproto=udp,local_lock=all,addr=10.0.0.5
312 22 0:56 / /mnt/shared rw,relatime shared:172 - nfs4 fs.example.com:/ rw,vers=4.2,rsize=1048576,wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.7,local_lock=none,addr=10.0.0.9
313 22 0:57 / /mnt/team\040models rw,relatime shared:173 - nfs4 fs.example.com:/team rw,vers=4.1,hard,proto=tcp,sec=sys,local_lock=flock,addr=10.0.0.9
314 311 259:2 / /mnt/models/scratch rw,relatime shared:174 - ext4 /dev/nvme1n1 rw
"""  # noqa: E501


@pytest.mark.parametrize(
    ("directory", "scope"),
    [
        ("/mnt/models/cache", "nfs mounted with nolock,local_lock=all"),
        ("/mnt/shared/cache", None),  # NFSv4 locks: the server keeps them
        ("/mnt/team models/cache", "nfs4 mounted with local_lock=flock"),
        ("/mnt/models/scratch/cache", None),  # a local disk mounted over the NFS one
        ("/home/me/cache", None),
    ],
)
def test_nfs_with_locks_of_its_own_is_told_from_mountinfo(directory: str, scope: str | None) -> None:
    assert cache_module.lock_scope(Path(directory), NFS_MOUNTINFO) == scope


def test_on_nfs_without_shared_locks_a_load_never_removes_another_writers_partial(
    server: RangeServer, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """There another host's live writer holds a lock this host cannot see: its partial file is not a
    killed writer's. The load writes its own copies, takes no lock, removes nothing, warns once."""
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    mountinfo = tmp_path / "mountinfo"
    line = f"400 22 0:60 / {tmp_path} rw,relatime - nfs 10.0.0.5:/export rw,vers=3,hard,nolock,local_lock=all"
    mountinfo.write_text(NFS_MOUNTINFO + line + "\n")
    monkeypatch.setattr(cache_module, "MOUNTINFO", mountinfo)
    first = cache_path(cache, ObjectPath(f"{url}model-00001-of-00002.safetensors"))
    first.parent.mkdir(parents=True)
    theirs = Path(f"{first}.partial.otherhost.4242.abcd")
    theirs.write_bytes(b"\0" * 1000)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        streamload.load(url, device="cpu", cache_dir=cache)
        theirs_too = theirs.read_bytes()
        assert_later_loads_exact(url, cache, store)
    assert theirs_too == b"\0" * 1000 and partials(cache) == [theirs]
    assert len(copies(cache)) == 2 and not list(cache.rglob("*.lock"))
    warned = [r.getMessage() for r in caplog.records if "locks are not seen by other hosts" in r.getMessage()]
    assert len(warned) == 1 and str(cache) in warned[0] and "local_lock=all" in warned[0]


PG_TIMEOUT = 20.0  # seconds: a rank that waited for another's copy would wait most of it


def _cooperative_rank(rank: int, world: int, url: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT))  # fmt: skip
    started = time.monotonic()
    try:
        with streamload.iter(url, device="cpu", cooperative=True, cache_dir=cache) as stream:
            result: dict[str, Any] = {"hashes": hashes(dict(stream))}
    except streamload.StreamloadError as exc:
        result = {"error": str(exc)}
    result["seconds"] = time.monotonic() - started
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_cooperative_ranks_on_one_host_share_a_cache_dir_without_waiting_for_each_other(
    server: RangeServer, store: Path, tmp_path: Path
) -> None:
    """Each rank reads a part of every shared batch: no rank can complete a copy, so none is claimed
    (rank 0 used to claim all of them, and rank 1 waited for them until the group's timeout)."""
    url, cache = f"{server.url}/model/", tmp_path / "cache"
    start_ranks(_cooperative_rank, (2, url, str(cache), str(tmp_path)), 2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want = hashes(reference(store))
    assert all(r.get("hashes") == want for r in results), [r.get("error") for r in results]
    assert all(r["seconds"] < PG_TIMEOUT / 4 for r in results), results
    assert server.sent <= 1.05 * data_bytes(store)  # each byte once, for both ranks
    assert not partials(cache) and not copies(cache)


# -- loads of one object in one process ------------------------------------------------------------------
@pytest.mark.parametrize("faces", ["threads", "tasks"])
def test_two_loads_of_one_object_in_one_process_wait_for_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, faces: str
) -> None:
    """Two loads of the same URL with one cache_dir at once in one process (two engines, a reload beside a
    load): the second must not wait for a writer that is this very process (its reads can be what the
    first's need), which stalled both until the writer was given up on (WRITER_STALL: 180 s)."""
    import asyncio
    import threading

    from streamload.base import limits

    monkeypatch.setattr(cache_module, "WRITER_STALL", 20.0)
    before = limits.usage().reader_threads
    streamload.set_limits(reader_threads=2)  # a small pool: the second load's waits held all of it
    request.addfinalizer(lambda: streamload.set_limits(reader_threads=before))
    www = tmp_path / "www"
    (www / "big").mkdir(parents=True)
    tensors = {f"layers.{k}.w": random_tensor(torch.float32, (1024, 1024), seed=k) for k in range(24)}
    save_file(tensors, www / "big" / "model.safetensors")  # 96 MiB: many reads in flight at once
    big = RangeServer(www, rate=64 << 20)
    request.addfinalizer(big.close)
    url, cache = f"{big.url}/big/", tmp_path / "cache"
    got: list[dict[str, torch.Tensor]] = []
    began = time.monotonic()
    if faces == "threads":
        threads = [threading.Thread(target=lambda: got.append(streamload.load(url, device="cpu", cache_dir=cache)))
                   for _ in range(2)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE)
    else:

        async def both() -> None:
            async def one() -> None:
                async with streamload.iter(url, device="cpu", cache_dir=cache) as stream:
                    got.append({name: t async for name, t in stream})

            await asyncio.gather(one(), one())

        asyncio.run(both())
    took = time.monotonic() - began
    assert len(got) == 2 and took < 15, took  # ~2 s each at the store's rate; a wait for itself: 20 s
    for state in got:
        assert state.keys() == tensors.keys() and all(same_bits(state[n], tensors[n]) for n in tensors)
    kept = [p for p in cache.rglob("*.safetensors") if Path(f"{p}{cache_module.RECORD}").exists()]
    assert len(kept) == 1, kept  # the first load's copy was kept all the same


def test_a_records_version_is_named_as_earlier_releases_named_it() -> None:
    """Copies an earlier release cached stay valid, and peers of either release agree on a version's tag: the
    record's name of a version is fixed, whatever messages show."""
    from datetime import datetime, timezone

    from streamload.format.header import FileVersion

    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert FileVersion(9, etag='"abc"').recorded() == 'etag:"abc"'
    assert FileVersion(9, weak='W/"x"', modified=when).recorded() == 'weak:W/"x":2026-01-02 03:04:05+00:00'
    assert FileVersion(9, modified=when).recorded() == "modified:2026-01-02 03:04:05+00:00"
    assert FileVersion(9).recorded() == "size"
    assert FileVersion(9, etag='"abc"', generation="17").recorded() == 'etag:"abc":generation:17'
