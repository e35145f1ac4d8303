"""A process forked after a remote load can load remotely too (a DataLoader worker, a prefork
server): the child has none of its parent's threads, so neither the event loop thread the requests
ran on nor obstore's runtime; the remote layer starts its own in the child, and the child's exit does
not wait on the parent's loop. The fork happens in a process of its own (the test runner itself
never forks with threads running), whose whole session is killed on every exit path."""

from __future__ import annotations

import json
import os
import signal
import subprocess  # nosec B404 # this test's own interpreter, an argv list
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from .servers import RangeServer, s3_server, upload

pytest.importorskip("obstore")

BOUND = 90.0  # seconds the forking process may take: a hang in the child would be for ever
EXIT = 2.0  # seconds a child's exit may take (it waited 6 s on its parent's loop)

# The forking process: loads ONE in the parent (and keeps a storage it made), forks; the child loads
# ONE and TWO and reads TWO's header through the parent's storage (unless told to load nothing), then
# exits normally (atexit runs).
SCRIPT = r"""
import json, os, sys, time
import torch
from safetensors.torch import load_file
import streamload
from streamload.storage import storage_for
from streamload.storage.remote import ObjectPath

base, folder, out, loads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5] != "nothing"
def exact(name):
    got = streamload.load(f"{base}/{name}", device="cpu")
    want = load_file(os.path.join(folder, name))
    return sorted(got) == sorted(want) and all(
        torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
storage = storage_for(f"{base}/one.safetensors")
storage.header(ObjectPath(f"{base}/one.safetensors"))
report = {"parent": exact("one.safetensors")}
child = os.fork()
if child == 0:
    said = {}
    if sys.argv[5] == "no-tmp":  # nowhere to put a fresh copy of obstore
        import tempfile
        tempfile.tempdir = os.path.join(folder, "no-such-folder")
    try:
        if not loads:
            raise SystemExit
        said["one"], said["two"] = exact("one.safetensors"), exact("two.safetensors")
        said["kept_storage"] = storage.header(ObjectPath(f"{base}/two.safetensors")).size
    except SystemExit:
        pass
    except Exception as exc:
        said["error"], said["unsupported"] = str(exc), isinstance(exc, streamload.UnsupportedError)
    said["exiting"] = time.monotonic()
    with open(out + ".child", "w") as f:
        json.dump(said, f)
    sys.exit(0)
deadline = time.monotonic() + float(sys.argv[4])
while os.waitpid(child, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:
        report["hung"] = True
        os.kill(child, 9)
        os.waitpid(child, 0)
        break
    time.sleep(0.01)
report["reaped"] = time.monotonic()
with open(out, "w") as f:
    json.dump(report, f)
"""


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two small checkpoints, of other tensors."""
    folder = tmp_path_factory.mktemp("fork") / "model"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    one = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(7, generator=g).half()}
    save_file(one, folder / "one.safetensors")
    save_file({"c": torch.randn(128, 3, generator=g).to(torch.bfloat16)}, folder / "two.safetensors")
    return folder


@pytest.fixture(params=["http", "s3"])
def base(request: pytest.FixtureRequest, objects: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The URL the objects are under: an HTTP server with Range and ETags, or moto's S3 server."""
    if request.param == "http":
        server = RangeServer(objects.parent)
        try:
            yield f"{server.url}/model"
        finally:
            server.close()
        return
    pytest.importorskip("moto")
    with s3_server(monkeypatch) as s3:
        upload(s3, "models", "model/", objects)
        yield "s3://models/model"


def _run(base: str, objects: Path, out: Path, child: str = "load") -> dict[str, object]:
    """Run SCRIPT in a session of its own; kill the whole session (the forked child too) however it ends."""
    argv = [sys.executable, "-c", SCRIPT, base, str(objects), str(out), str(BOUND - 20), child]
    process = subprocess.Popen(  # nosec B603 # this interpreter, an argv list
        argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        output, _ = process.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the forking process did not end within {BOUND} s")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0 and out.exists(), output.decode(errors="replace")[-3000:]
    report = json.loads(out.read_text())
    report["child"] = json.loads(Path(f"{out}.child").read_text()) if Path(f"{out}.child").exists() else None
    return report


def test_a_child_forked_after_a_remote_load_loads_remotely_and_exits_at_once(
    base: str, objects: Path, tmp_path: Path
) -> None:
    """The child loads the object its parent loaded and another one, exactly, within the bound (it
    hung for ever), reads through a storage its parent made, and its exit takes < 2 s (it waited
    6 s for its parent's loop thread, which the child does not have)."""
    report = _run(base, objects, tmp_path / "report.json")
    child = report["child"]
    assert report["parent"] is True, report
    assert not report.get("hung") and isinstance(child, dict), report
    assert child.get("one") is True and child.get("two") is True, child
    assert child["kept_storage"] == (objects / "two.safetensors").stat().st_size, child
    exit_took = float(report["reaped"]) - float(child["exiting"])  # type: ignore[arg-type]
    assert exit_took < EXIT, f"the child's exit took {exit_took:.2f} s"


def test_a_child_forked_after_a_remote_load_that_loads_nothing_exits_at_once(
    base: str, objects: Path, tmp_path: Path
) -> None:
    """The child makes no request: its exit does not wait on its parent's loop, which it does not run."""
    report = _run(base, objects, tmp_path / "report.json", child="nothing")
    child = report["child"]
    assert report["parent"] is True and not report.get("hung") and isinstance(child, dict), report
    assert "error" not in child, child
    exit_took = float(report["reaped"]) - float(child["exiting"])  # type: ignore[arg-type]
    assert exit_took < EXIT, f"the child's exit took {exit_took:.2f} s"


def test_a_child_that_cannot_load_obstore_afresh_fails_at_once_saying_why(
    base: str, objects: Path, tmp_path: Path
) -> None:
    """No temporary folder to load a fresh obstore from: the child's load fails at once, one line
    naming the store and what to do, and the child exits at once."""
    report = _run(base, objects, tmp_path / "report.json", child="no-tmp")
    child = report["child"]
    assert not report.get("hung") and isinstance(child, dict), report
    error = str(child.get("error", ""))
    assert child.get("unsupported") is True and error.startswith(base.rsplit("/", 1)[0]) and "\n" not in error, child
    assert "forked" in error and "'spawn' or 'forkserver'" in error and "no-such-folder" in error, child
    exit_took = float(report["reaped"]) - float(child["exiting"])  # type: ignore[arg-type]
    assert exit_took < EXIT, f"the child's exit took {exit_took:.2f} s"
