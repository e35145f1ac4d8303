"""What cooperative ranks may trust of each other: that they read the same bytes (ranks given other
files or versions are refused, identical copies load together), and that a rank leaving the load says
so (a `break`, an exception in the loop, a failing `iter()`): its peers read its share at once instead
of waiting for the process group's timeout."""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import re
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import streamload

from .conftest import PRELOADED, in_environment, random_tensor, same_bits
from .servers import RangeServer

# Small slots, so that a load is many shared batches (a rank can leave in the middle of it).
TINY = {"ring_bytes": 1 << 17, "slots": 2, "chunk_bytes": 1 << 15}
NAMES = [f"layers.{i}.weight" for i in range(8)]
LONG = 60.0  # the process group's timeout where a rank leaves: the others must not wait for it
SHORT = 8.0  # elsewhere: a rank waiting for another (on the old code) gives up soon
BOUND = 150.0  # seconds any run of ranks may take, whatever happens


def write_model(folder: Path, seed: int, change: dict[str, int] | None = None) -> Path:
    """8 tensors of 64 KiB, values from `seed`; `change` flips one byte at {tensor name: byte offset}."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {n: random_tensor(torch.float32, (64, 256), seed=seed + i) for i, n in enumerate(NAMES)}
    for name, at in (change or {}).items():
        state[name].view(torch.uint8).view(-1)[at] ^= 0xFF
    save_file(state, folder / "model.safetensors")
    return folder / "model.safetensors"


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a/ and b/: one layout, other values; c/: a byte for byte copy of a/ (another inode and mtime);
    m/: a/ with one byte of a tensor in the middle of the file changed."""
    root = tmp_path_factory.mktemp("versions")
    a = write_model(root / "a", seed=1)
    b = write_model(root / "b", seed=101)
    (root / "c").mkdir()
    time.sleep(0.01)  # another mtime, to the nanosecond
    shutil.copyfile(a, root / "c" / "model.safetensors")
    m = write_model(root / "m", seed=1, change={NAMES[3]: 1000})
    return {"root": root, "a": a, "b": b, "c": root / "c" / "model.safetensors", "m": m}


@pytest.fixture(scope="module")
def server(versions: dict[str, Path]) -> Iterator[RangeServer]:
    s = RangeServer(versions["root"])
    yield s
    s.close()


class LoopError(Exception):
    """What the loop body of a leaving rank raises."""


def _rank(rank: int, world: int, out: str, job: dict[str, Any]) -> None:
    """One rank: load `job["sources"][rank]` cooperatively, stopping as `job["stop"]` says for this
    rank; write what it got (exact against its own file?), the error it met and its warnings."""
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logging.getLogger("streamload").addHandler(Keep(logging.WARNING))
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job["timeout"]))  # fmt: skip
    stop = job.get("stop", {}).get(str(rank))
    result: dict[str, Any] = {}
    if "host" in job:
        _as_host(job["host"][rank], result)
    options: dict[str, Any] = {"cooperative": True, "device": "cpu", **TINY, **job.get("options", {})}
    if stop == "bad argument":
        options["slots"] = -3  # this rank's iter() fails before its first read
    got: dict[str, torch.Tensor] = {}
    started = time.monotonic()
    try:
        if stop == "drop":  # a plain `for` over a dropped stream: garbage collection closes it
            for name, t in streamload.iter(job["sources"][rank], **options):
                got[name] = t.clone()
                if len(got) == 2:
                    break
            raise LoopError("dropped")
        with streamload.iter(job["sources"][rank], **options) as stream:
            for name, t in stream:
                got[name] = t.clone()
                if len(got) == 2 and stop == "break":
                    break
                if len(got) == 2 and stop == "raise":
                    raise LoopError("the loop body failed")
        result["bytes_read"] = stream.stats.bytes_read
    except streamload.StreamloadError as exc:
        result["error"] = str(exc)
    except (LoopError, ValueError) as exc:
        result["raised"] = str(exc)
    result["seconds"] = time.monotonic() - started
    want = load_file(job["expect"][rank])
    result["got"] = sorted(got)
    result["exact"] = all(same_bits(t, want[n]) for n, t in got.items())
    result["whole"] = sorted(got) == sorted(want)
    result["warnings"] = warned
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if stop:  # alive, but gone from the load, until the others are done
        others = [Path(out, f"rank{r}.json") for r in range(world) if str(r) not in job["stop"]]
        deadline = time.monotonic() + BOUND
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.1)
    dist.destroy_process_group()


# What an identically provisioned image's files look like on each host: one device, inode and mtime.
CLONED = (2049, 1234567, 1_700_000_000_000_000_000)


def _as_host(host: dict[str, Any], result: dict[str, Any]) -> None:
    """This rank plays a host of its own: `host["boot"]` its identity (the boot id), every local file
    of the one (device, inode, mtime) of an image provisioned alike on every host (`CLONED`), its file
    system a network one (`host["mount"]`: type, source) where given; `result["fingerprinted"]` says
    whether it had to compare the files' bytes with the others'."""
    from streamload.cooperative import agreement
    from streamload.format.header import FileVersion
    from streamload.storage import local

    device, inode, mtime = CLONED
    local.file_identity = lambda st: FileVersion(st.st_size, device=device, inode=inode, mtime_ns=mtime)  # type: ignore[assignment]
    agreement._host_identity = lambda: host["boot"]  # type: ignore[attr-defined]
    mount = tuple(host["mount"]) if host.get("mount") else None
    agreement._network_mounts = lambda: {device: mount} if mount else {}  # type: ignore[attr-defined]
    fingerprints = agreement.fingerprints
    result["fingerprinted"] = False

    def counted(*args: Any) -> Any:
        result["fingerprinted"] = True
        return fingerprints(*args)

    agreement.fingerprints = counted  # type: ignore[assignment]


def run_ranks(out: Path, job: dict[str, Any], world: int = 2) -> list[dict[str, Any]]:
    """Start `world` ranks running `job` and wait for them, at most BOUND seconds (then they are killed)."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOADED)
    target = functools.partial(in_environment, dict(os.environ), _rank)
    ranks = mp.start_processes(target, args=(world, str(out), job), nprocs=world, start_method="forkserver",
                               join=False)  # fmt: skip
    deadline = time.monotonic() + BOUND
    try:
        while not ranks.join(timeout=1.0):
            assert time.monotonic() < deadline, f"the ranks did not end within {BOUND} s"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# -- item 2: the ranks read the same bytes ---------------------------------------------------------


def sources(versions: dict[str, Path], names: tuple[str, ...], server: RangeServer | None) -> list[str]:
    return [f"{server.url}/{n}/model.safetensors" if server else str(versions[n]) for n in names]


@pytest.mark.parametrize("where", ["local", "http"])
def test_ranks_given_other_versions_of_a_file_are_refused(
    versions: dict[str, Path], server: RangeServer, tmp_path: Path, where: str
) -> None:
    """Same names, dtypes, shapes and offsets, other values: every rank refuses, naming the files and
    the ranks; none hands out a tensor of the other's file."""
    job = {"sources": sources(versions, ("a", "b"), server if where == "http" else None),
           "expect": [str(versions["a"]), str(versions["b"])], "timeout": SHORT}  # fmt: skip
    results = run_ranks(tmp_path, job)
    for rank, r in enumerate(results):
        error = r.get("error", "")
        assert "different" in error and "rank 0" in error and "rank 1" in error, (rank, r)
        assert "a/model.safetensors" in error and "b/model.safetensors" in error, (rank, r)
        assert not r["got"], (rank, r)


def test_versions_that_differ_in_the_middle_are_refused_by_their_digests(
    versions: dict[str, Path], tmp_path: Path
) -> None:
    """One byte of a tensor in the middle of the file differs: the digest files next to them tell."""
    from streamload.pipeline.verify import write_digests

    for n in ("a", "m"):
        shutil.copytree(versions[n].parent, tmp_path / n)
        write_digests(streamload.inspect(tmp_path / n))
    job = {"sources": [str(tmp_path / "a"), str(tmp_path / "m")],
           "expect": [str(versions["a"]), str(versions["m"])], "timeout": SHORT}  # fmt: skip
    (tmp_path / "run").mkdir()
    for rank, r in enumerate(run_ranks(tmp_path / "run", job)):
        assert "different" in r.get("error", "") and not r["got"], (rank, r)


@pytest.mark.parametrize("where", ["local", "http"])
def test_identical_copies_in_other_folders_load_together_exactly(
    versions: dict[str, Path], server: RangeServer, tmp_path: Path, where: str
) -> None:
    """A copy on each host's own disk (another path, inode and mtime, or another URL and ETag) holds
    the same bytes: the ranks load cooperatively, each reading a share."""
    job = {"sources": sources(versions, ("a", "c"), server if where == "http" else None),
           "expect": [str(versions["a"]), str(versions["c"])], "timeout": SHORT}  # fmt: skip
    results = run_ranks(tmp_path, job)
    assert all(r["exact"] and r["whole"] for r in results), results
    total = versions["a"].stat().st_size
    assert sum(r["bytes_read"] for r in results) < total  # each read a share, not the whole file
    assert all(r["bytes_read"] < total * 0.7 for r in results), results


def test_equal_file_identities_on_other_hosts_prove_nothing(versions: dict[str, Path], tmp_path: Path) -> None:
    """Two hosts of one image: their files have the same device, inode, size and mtime, but their bytes
    differ (a/ and b/). Equal local identities are no proof across hosts: the ranks compare the bytes
    and refuse, naming both files."""
    hosts = [{"boot": "host-a"}, {"boot": "host-b"}]
    job = {"sources": sources(versions, ("a", "b"), None), "expect": [str(versions["a"]), str(versions["b"])],
           "timeout": SHORT, "host": hosts}  # fmt: skip
    for rank, r in enumerate(run_ranks(tmp_path, job)):
        error = r.get("error", "")
        assert "different" in error and "a/model.safetensors" in error and "b/model.safetensors" in error, (rank, r)
        assert not r["got"] and r["fingerprinted"], (rank, r)


@pytest.mark.parametrize(
    "hosts",
    [
        [{"boot": "host-a"}, {"boot": "host-a"}],  # two ranks on one host: one file
        [{"boot": "host-a", "mount": ["nfs4", "nas:/models"]}, {"boot": "host-b", "mount": ["nfs4", "nas:/models"]}],
    ],
    ids=["one host", "one network file system"],
)
def test_one_file_agrees_at_no_cost_on_one_host_or_one_network_file_system(
    versions: dict[str, Path], tmp_path: Path, hosts: list[dict[str, Any]]
) -> None:
    """Equal identities on one host, or on one network file system every host mounts (NFS: its
    server's inode numbers and times, the same on every host), are one file: the ranks load together,
    exactly, without comparing bytes."""
    path = str(versions["a"])
    job = {"sources": [path, path], "expect": [path, path], "timeout": SHORT, "host": hosts}
    results = run_ranks(tmp_path, job)
    for rank, r in enumerate(results):
        assert r["exact"] and r["whole"] and not r["fingerprinted"], (rank, r)
    assert sum(r["bytes_read"] for r in results) < versions["a"].stat().st_size  # each read a share


def test_identical_copies_on_other_hosts_agree_by_their_bytes(versions: dict[str, Path], tmp_path: Path) -> None:
    """Two hosts of one image whose copies hold the same bytes (a/ and c/): compared, they agree."""
    hosts = [{"boot": "host-a"}, {"boot": "host-b"}]
    job = {"sources": sources(versions, ("a", "c"), None), "expect": [str(versions["a"]), str(versions["c"])],
           "timeout": SHORT, "host": hosts}  # fmt: skip
    for rank, r in enumerate(run_ranks(tmp_path, job)):
        assert r["exact"] and r["whole"] and r["fingerprinted"], (rank, r)


def test_network_file_systems_are_told_from_a_hosts_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the mount table: NFS (its export and server address), CephFS and Lustre are network
    file systems; a disk, an overlay, tmpfs and FUSE (its inode numbers are each host's daemon's) are
    not, nor is a line that cannot be read."""
    from streamload.cooperative import agreement

    table = tmp_path / "mountinfo"
    table.write_text(
        "29 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"
        "30 29 0:52 / /models rw,relatime shared:9 - nfs4 nas:/export/models rw,vers=4.2,addr=10.0.0.5,sec=sys\n"
        "31 29 0:53 / /cephfs rw - ceph 10.0.0.7:6789:/ rw,name=admin\n"
        "32 29 0:54 / /lustre rw - lustre 10.0.0.8@tcp:/fs rw,flock\n"
        "33 29 0:55 / /merged rw - overlay overlay rw,lowerdir=/l\n"
        "34 29 0:56 / /sshfs rw,nosuid - fuse.sshfs host:/x rw,user_id=0\n"
        "35 29 0:57 / /tmp rw - tmpfs tmpfs rw\n"
        "garbage - nfs4\n"
    )
    monkeypatch.setattr(agreement, "_MOUNTINFO", str(table))
    assert agreement._network_mounts() == {
        os.makedev(0, 52): ("nfs4", "nas:/export/models", "10.0.0.5"),
        os.makedev(0, 53): ("ceph", "10.0.0.7:6789:/", ""),
        os.makedev(0, 54): ("lustre", "10.0.0.8@tcp:/fs", ""),
    }
    monkeypatch.setattr(agreement, "_MOUNTINFO", str(tmp_path / "absent"))
    assert agreement._network_mounts() == {}


def test_an_object_on_a_loopback_server_is_each_hosts_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """One URL, size and ETag name one object version, except on a loopback server (each host's own,
    whose ETags are often its files' mtime and size): there the version names the host too."""
    from types import SimpleNamespace

    from streamload.cooperative import agreement
    from streamload.format.header import FileVersion

    objects = SimpleNamespace(storage=SimpleNamespace(local=False))

    def on(host: str, url: str) -> bytes:
        monkeypatch.setattr(agreement, "_host_identity", lambda: host)
        header = SimpleNamespace(path=url, size=10, identity=FileVersion(10, etag='"5f-a"'))
        return agreement.version(header, objects, {})  # type: ignore[arg-type]

    for url in ("http://127.0.0.1:8080/m/model.safetensors", "http://localhost/m/a.safetensors",
                "http://user:pw@[::1]:9/a.safetensors"):  # fmt: skip
        assert on("host-a", url) != on("host-b", url) and on("host-a", url) == on("host-a", url), url
    for url in ("http://10.0.0.5/m/model.safetensors", "s3://bucket/m/model.safetensors"):
        assert on("host-a", url) == on("host-b", url), url


# -- item 5: a rank that leaves says so ------------------------------------------------------------


@pytest.mark.parametrize("stop", ["break", "drop", "raise", "bad argument"])
def test_a_rank_that_leaves_early_tells_the_others_at_once(
    versions: dict[str, Path], tmp_path: Path, stop: str
) -> None:
    """Rank 1 leaves (a `break` after 2 tensors, in a `with` block or a plain `for`, an exception in its
    loop, or its iter() fails on a bad argument) and stays alive: rank 0 reads its share itself at once,
    not after the group's timeout, and its warning names rank 1 and how long it waited."""
    path = str(versions["a"])
    job = {"sources": [path, path], "expect": [path, path], "timeout": LONG, "stop": {"1": stop}}
    survivor, leaver = run_ranks(tmp_path, job)
    assert survivor["exact"] and survivor["whole"], survivor
    assert survivor["seconds"] < 15, survivor  # not the group's 60 s (nor 80% of them)
    assert leaver["exact"] and (leaver["raised"] if stop != "break" else len(leaver["got"]) == 2), leaver
    said = [w for w in survivor["warnings"] if re.search(r"\brank 1\b.*\bleft\b", w)]
    assert said, survivor["warnings"]
    waited = [float(s) for w in said for s in re.findall(r"after (\d+(?:\.\d+)?) s\b", w)]
    assert waited and all(s < 15 for s in waited), said


def test_the_others_share_the_share_of_a_rank_that_left(versions: dict[str, Path], tmp_path: Path) -> None:
    """Three replicas, rank 1 breaks: ranks 0 and 2 go on together at once, reading its share a half each."""
    path = str(versions["a"])
    job = {"sources": [path] * 3, "expect": [path] * 3, "timeout": LONG, "stop": {"1": "break"}}
    results = run_ranks(tmp_path, job, world=3)
    for r in (results[0], results[2]):
        assert r["exact"] and r["whole"] and r["seconds"] < 15, r
    total = versions["a"].stat().st_size
    assert results[0]["bytes_read"] + results[2]["bytes_read"] < total  # rank 1's share read once, not twice
