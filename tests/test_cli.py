"""The command line: the demo runs end to end; bad arguments give a one-line message and exit 2."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamload
from streamload.commands.cli import main
from streamload.commands.demo import Shape, llama_tensors, write_checkpoint

from .cli_runs import cli, one_line_error, small_checkpoint
from .conftest import Mount, same_bits


def test_demo_checkpoint_is_llama_shaped_and_loads(tmp_path: Path) -> None:
    shape = Shape(vocab=64, hidden=32, intermediate=48, layers=3)
    write_checkpoint(tmp_path, shape, shards=2)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    state = streamload.load(tmp_path, device="cpu")
    assert {n: tuple(t.shape) for n, t in state.items()} == llama_tensors(shape)
    for f in tmp_path.glob("*.safetensors"):
        for name, t in load_file(f).items():
            assert same_bits(state[name], t)


def test_demo_files_follow_the_umask(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        write_checkpoint(tmp_path, Shape(vocab=64, hidden=32, intermediate=48, layers=1), shards=2)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_demo_command_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "streamload", "demo", "--warm", "--keep", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "111 tensors" in out.stdout and "GB/s" in out.stdout and "first full layer" in out.stdout


def test_demo_keep_onto_an_existing_file_is_one_line_and_leaves_the_file(tmp_path: Path) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    one_line_error(cli("demo", "--warm", "--device", "cpu", "--keep", str(existing)), str(existing), "not a directory")
    assert existing.read_text() == "mine"


def test_demo_keep_in_a_read_only_place_is_one_line(mount: Mount) -> None:
    read_only = mount(read_only=True)
    for target in (read_only, read_only / "demo"):  # the folder itself, and one to be made there
        line = one_line_error(cli("demo", "--warm", "--device", "cpu", "--keep", str(target)), str(target))
        assert "Read-only file system" in line or "not writable" in line, line


def test_demo_keep_on_a_full_disk_is_one_line_and_leaves_no_half_written_shard(mount: Mount) -> None:
    disk = mount(size=1 << 20)  # the demo's checkpoint is ~0.4 GB
    line = one_line_error(cli("demo", "--warm", "--device", "cpu", "--keep", str(disk / "demo")), str(disk / "demo"))
    assert "No space left on device" in line, line
    assert list((disk / "demo").iterdir()) == []


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small")
    write_checkpoint(path, Shape(vocab=256, hidden=64, intermediate=96, layers=4), shards=2)
    return path


def test_inspect_json(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["inspect", str(small_model), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["files"]) == 2 and doc["layers"] == 4 and doc["tensor_count"] == len(doc["tensors"]) == 4 * 9 + 3
    assert set(doc["tensors_per_layer"].values()) == {9}
    first = doc["tensors"][0]
    assert first["name"] == "model.embed_tokens.weight" and first["layer"] is None and first["dtype"] == "BF16"
    assert first["shape"] == [256, 64] and first["byte_range"][1] - first["byte_range"][0] == 256 * 64 * 2
    assert [t["layer"] for t in doc["tensors"][1:10]] == ["model.layers.0"] * 9
    assert doc["largest"]["name"] in ("model.embed_tokens.weight", "lm_head.weight")
    assert doc["bytes"] == sum(v["bytes"] for v in doc["dtypes"].values())


def test_inspect_lists_layers_in_natural_order_and_says_singulars(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    save_file({f"model.layers.{i}.w": torch.ones(2) for i in range(12)}, tmp_path / "m.safetensors")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["tensors_per_layer"]) == [f"model.layers.{i}" for i in range(12)]
    save_file({"model.layers.0.w": torch.ones(2)}, tmp_path / "m.safetensors")
    assert main(["inspect", str(tmp_path)]) == 0
    assert "1 tensor, 0.000 GB; 1 layer x 1 tensor" in capsys.readouterr().out


def test_version_and_help_show_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"streamload {streamload.__version__}"
    for command in ("demo", "load", "bench", "inspect"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        options = [line for line in text.splitlines() if line.strip().startswith("--") and "--help" not in line]
        assert options and "default" in " ".join(text.split()), command
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "Defaults: a warm page cache, 5 runs, on the cpu." in " ".join(capsys.readouterr().out.split())


def test_unknown_device_and_integer_dtype_are_one_line_errors(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", str(small_model), "--device", "gpu"]) == 1
    assert main(["load", str(small_model), "--device", "cpu", "--dtype", "int8"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "device 'gpu' is not a device torch knows" in err[0]
    assert "dtype=torch.int8 would truncate floating-point weights" in err[1]


def _interrupted(script: str, ready: str, settle: float = 0.0) -> tuple[int, str]:
    """Run `script` in a fresh interpreter, Ctrl-C it once it printed `ready` (and `settle` seconds
    passed); its exit code and stderr."""
    import signal

    # A shell that starts jobs in the background has them ignore SIGINT, and children inherit that:
    # the child gets Python's usual Ctrl-C handling whatever started the tests.
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == ready
    time.sleep(settle)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def test_ctrl_c_during_load_is_one_line_and_exit_130(small_model: Path) -> None:
    code, err = _interrupted(
        "import sys, time, streamload.commands.cli as c, streamload.pipeline.stream as s\n"
        "real = s.TensorStream.__next__\n"
        "def slow(self):\n    time.sleep(0.2)\n    return real(self)\n"
        "s.TensorStream.__next__ = slow\n"
        f"print('ready', flush=True)\nsys.exit(c.main(['load', {str(small_model)!r}, '--device', 'cpu']))",
        "ready", settle=0.5,
    )  # fmt: skip
    assert code == 130 and err.strip() == "streamload: interrupted"


def test_inspect_table(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(small_model)]) == 0
    out = capsys.readouterr().out
    assert "4 layers x 9 tensors" in out and "BF16" in out


def test_load_reports_plain_lines_when_not_a_tty(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(small_model), "--device", "cpu", "--dtype", "float16", "--reader", "posix"]) == 0
    out = capsys.readouterr().out
    assert "39 tensors" in out and "via posix" in out and "100%" in out


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(tmp_path / "missing")]) == 1
    assert main(["load", str(tmp_path), "--dtype", "float17"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("streamload: error:") for line in err)
    assert main(["bench"]) == 2  # no path: one line saying what it needs (or --list)
    with pytest.raises(SystemExit) as info:
        main(["bench", "x", "--runs", "0"])
    assert info.value.code == 2
    assert all(len(e.strip().splitlines()) == 1 for e in capsys.readouterr().err.split("streamload")[1:])
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    assert main(["load", str(tmp_path / "m.safetensors"), "--reader", "fast"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reader must be 'auto' or one of 'kvikio', 'mmap'" in err[0]


def test_bench_runs_loaders_and_writes_json_and_plot(small_model: Path, tmp_path: Path) -> None:
    import json

    argv = ["bench", str(small_model), "--runs", "1", "--cold", "--warm", "--json", str(tmp_path / "b.json"),
            "--plot", str(tmp_path / "b.png"), "--loaders", "streamload-mmap", "safetensors-load_file",
            "ceiling-read", "instanttensor"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["mode"], r["loader"]): r for r in doc["rows"]}
    assert set(rows) == {(m, ld) for m in ("cold", "warm") for ld in ("streamload-mmap", "safetensors-load_file",
                                                                          "ceiling-read")}  # fmt: skip
    for r in rows.values():
        assert r["seconds"] > 0 and r["peak_rss"] > 0
    assert rows[("warm", "safetensors-load_file")]["x_load_file"] == 1.0
    # Warm on the CPU no ceiling bounds a mapping loader; cold the storage ceiling does.
    assert rows[("warm", "streamload-mmap")]["of_ceiling"] is None
    assert rows[("cold", "streamload-mmap")]["of_ceiling"] is not None
    assert rows[("warm", "streamload-mmap")]["first_layer_s"] is not None
    raw = next(x for x in doc["raw"] if x["loader"] == "streamload-mmap")
    arrivals = raw["runs"][0]["arrivals"]
    assert arrivals[-1][1] == doc["bytes"] and all(a[0] <= b[0] for a, b in itertools.pairwise(arrivals))
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_failures_are_one_line_and_fail_the_command(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.commands import bench

    dump = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: Expected a torch.device " \
           "with a specified index or an integer, but got:cuda\n" + "arg = 0x7f" * 500  # fmt: skip
    assert bench.failure_line(dump) == "ValueError: Expected a torch.device with a specified index or an integer, " \
                                       "but got:cuda"  # fmt: skip
    assert len(bench.failure_line("x" * 5000)) == 200 and "\n" not in bench.failure_line("a\nb" * 3000)

    real = bench.run_child

    def flaky(loader: str, files: list[str], device: str, **kw: object) -> bench.Run:
        if loader == "safetensors-load_file":
            raise RuntimeError(f"{loader} failed: {bench.failure_line(dump)}")
        return real(loader, files, device, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "run_child", flaky)
    argv = ["bench", str(small_model), "--runs", "1", "--loaders", "streamload-mmap", "safetensors-load_file"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "failed in every run: safetensors-load_file" in err
    assert all(len(line) < 300 for line in err.splitlines())
    # A loader that cannot run here at all: nothing ran, which is a failure too, with the extra to install.
    assert main(["bench", str(small_model), "--runs", "1", "--loaders", "streamload-kvikio"]) == 1
    err = capsys.readouterr().err
    assert "no loader ran" in err and "does not run on cpu" in err


def test_bench_skip_hint_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamload.commands import bench

    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)  # as where kvikio is missing
    _, notes = bench.available(["streamload-kvikio"], "cuda:0")
    assert len(notes) == 1 and "'.[cu12]' or -e '.[cu13]'" in notes[0]


def test_bench_sweep_prints_one_line_per_setting_and_the_best_as_options(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.base import tuning as defaults
    from streamload.commands import bench

    files = [str(f.path) for f in streamload.inspect(small_model).files]
    options = {"ring_bytes": 1 << 20, "slots": 2, "threads": 2, "chunk_bytes": 1 << 16}
    run = bench.run_child("streamload-auto", files, "cpu", options)  # one real child with the options
    assert run.seconds > 0 and run.arrivals[-1][1] == streamload.inspect(small_model).nbytes

    def fake(loader: str, files: list[str], device: str, options: dict[str, int]) -> bench.Run:
        # Faster with more threads and larger requests: the best is the largest of both, whatever the ring.
        seconds = 1.0 / options["threads"] + 1.0 / options["chunk_bytes"] * (1 << 20)
        return bench.Run(seconds, [(seconds, 1)], seconds, None, 1)

    monkeypatch.setattr(bench, "run_child", fake)
    assert main(["bench", str(small_model), "--sweep"]) == 0
    out = capsys.readouterr().out.splitlines()
    base = defaults.tuning(defaults.HOST_STAGING, streamload.inspect(small_model).nbytes)
    assert out[0].endswith(f": {1.0 / base.threads + (1 << 20) / base.chunk_bytes:.3f} s") and "(defaults)" in out[0]
    settings = [line for line in out if ": " in line and line.endswith(" s") and not line.startswith("best:")]
    assert len(settings) == 27  # 3 x 3 x 3, the defaults among them
    best = next(line for line in out if line.startswith("best:"))
    assert f"threads={base.threads * 2} chunk=" in best and "x the defaults" in best
    assert "medians of 3 runs, the best's " in best  # repeated by default, with the spread
    assert f"--threads {base.threads * 2} --chunk-bytes {base.chunk_bytes * 4}" in out[-2]
    assert out[-1].strip().startswith("streamload.iter(path, ring_bytes=")


def test_digest_then_load_verify_and_inspect_shows_the_digests(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(small_model, model)
    assert main(["load", str(model), "--device", "cpu", "--verify"]) == 1
    assert "no digest is known" in capsys.readouterr().err
    assert main(["digest", str(model)]) == 0
    assert f"wrote {model / 'streamload.digests.json'}: 2 files" in capsys.readouterr().out
    assert main(["load", str(model), "--device", "cpu", "--verify"]) == 0
    total = sum(t.nbytes for t in streamload.inspect(model).tensors.values())
    assert f"verified: {total / 1e9:.2f} GB matched their digests" in capsys.readouterr().out
    assert main(["inspect", str(model), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert all(f["digest"]["per_tensor"]["block_bytes"] == 1 << 20 for f in files)
    assert all(len(f["digest"]["whole_file"]["hex"]) == 64 for f in files)
    assert main(["inspect", str(small_model)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no digest known for 2 files: `streamload digest" in out and "| none" not in out


def test_digest_of_a_read_only_folder_names_the_folder(mount: Mount) -> None:
    folder = mount(fill=small_checkpoint, read_only=True)
    line = one_line_error(cli("digest", str(folder)), f"{folder}: cannot write streamload.digests.json there")
    assert ".streamload.digests.json." not in line  # the folder, not a temporary file's name


def test_digest_on_a_full_disk_names_the_folder_and_leaves_no_temporary_file(mount: Mount) -> None:
    def fill(point: Path) -> None:
        small_checkpoint(point)
        with open(point / "filler", "wb", buffering=0) as f:  # every byte left taken
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass

    folder = mount(size=1 << 20, fill=fill)
    one_line_error(cli("digest", str(folder)), str(folder), "No space left on device")
    assert sorted(p.name for p in folder.iterdir() if "digests" in p.name) == []


def test_sizes_take_units_and_bad_numbers_say_what_is_wrong(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.commands.cli import _size

    assert [_size(s) for s in ("4096", "4MiB", "4M", "4MB", "1.5GiB", "512 KiB")] == [
        4096, 4 << 20, 4 << 20, 4_000_000, 3 << 29, 512 << 10]  # fmt: skip
    assert main(["load", str(small_model), "--device", "cpu", "--chunk-bytes", "64KiB", "--ring-bytes", "1MiB"]) == 0
    capsys.readouterr()
    for flag, value, says in (("--chunk-bytes", "4XB", "'4XB' is not a size"), ("--threads", "two", "not a whole")):
        with pytest.raises(SystemExit) as info:
            main(["load", str(small_model), flag, value])
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and "_positive" not in err and "_size" not in err
    with pytest.raises(SystemExit):
        main(["load", "--help"])
    assert "4MiB" in capsys.readouterr().out


def test_non_tty_progress_counts_what_was_handed_out(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(small_model), "--device", "cpu", "--reader", "posix", "--ring-bytes", "64KiB"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "%" in line]
    last = lines[-1].split()
    assert last[0] == "100%" and last[-2] == "39/39"  # the percentage is of tensors handed out, not bytes read ahead


def test_the_progress_bar_shows_the_rate_the_summary_prints(small_model: Path) -> None:
    """One load, one rate: the bar shows bytes read over the stream's elapsed time, as the summary does
    (rich's own estimate left out the planning and the first read: 1.9 against 1.11 GB/s)."""
    import io

    from rich.console import Console

    import streamload
    from streamload.base.progress import progress_bar

    console = Console(file=io.StringIO(), force_terminal=True, width=150)
    stream = streamload.iter(small_model, device="cpu", reader="posix", ring_bytes=65536)
    with progress_bar(console=console) as progress, stream:
        task = progress.add_task("loading", total=stream.stats.bytes_total, stats=stream.stats)
        for _ in stream:
            progress.update(task, completed=stream.stats.bytes_read)
    shown = re.findall(r"(\d+\.\d\d) GB/s", console.file.getvalue())  # type: ignore[attr-defined]
    assert shown and shown[-1] == f"{stream.stats.gbps:.2f}"


def test_inspect_json_into_a_closed_pipe_is_quiet(small_model: Path) -> None:
    # `streamload inspect --json | head -1`: the reader leaves early; no BrokenPipeError traceback
    proc = subprocess.run(
        f"{sys.executable} -m streamload inspect --json {small_model} | head -c 10", shell=True,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.stdout == '{\n  "files"'[:10] and proc.stderr == ""


def test_ctrl_c_while_torch_is_importing_is_one_line(small_model: Path) -> None:
    # torch's import is made slow, so the signal lands inside it (as it does on a cold start)
    code, err = _interrupted(
        "import sys, time, builtins\n"
        "real = builtins.__import__\n"
        "def slow(name, *a, **k):\n"
        "    if name == 'torch' and 'torch' not in sys.modules:\n"
        "        print('importing', flush=True)\n"
        "        for _ in range(3000): time.sleep(0.01)\n"  # not one sleep: a signal just before it waited 30 s
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = slow\n"
        "from streamload.commands.cli import main\n"
        f"sys.exit(main(['load', {str(small_model)!r}, '--device', 'cpu']))",
        "importing",
    )  # fmt: skip
    assert code == 130 and err.strip() == "streamload: interrupted"


def test_bench_from_a_folder_holding_a_streamload_folder(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A clone's parent: `streamload/` there is not the installed package and must not be imported by the runs.
    (tmp_path / "streamload").mkdir()
    (tmp_path / "streamload" / "__init__.py").write_text("")
    (tmp_path / "model").symlink_to(small_model)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "model", "--runs", "1", "--loaders", "streamload-mmap", "streamload-posix"]) == 0
    out = capsys.readouterr()
    assert "| streamload-mmap |" in out.out and "failed" not in out.err


def test_bench_plot_without_matplotlib_fails_before_running(
    small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from streamload.commands import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(bench, "run_child", lambda *a, **k: pytest.fail("ran a load before checking --plot"))
    assert main(["bench", str(small_model), "--plot", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr().err.strip() == "streamload: error: --plot needs matplotlib: pip install matplotlib"


def test_bench_into_a_folder_it_cannot_write_fails_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mount: Mount
) -> None:
    import streamload.commands.bench

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran before its output's folder was checked")

    monkeypatch.setattr(streamload.commands.bench, "bench", ran)
    (tmp_path / "model").mkdir()
    folder = small_checkpoint(tmp_path / "model")
    missing = tmp_path / "no-such-folder" / "b.json"
    assert main(["bench", str(folder), "--device", "cpu", "--json", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"streamload: error: --json {missing}: cannot write there: No such file or directory" in err, err
    read_only = mount(size=64 << 10, read_only=True) / "b.json"  # refuses root too, where a mode does not
    assert main(["bench", str(folder), "--device", "cpu", "--json", str(read_only)]) == 1
    assert f"--json {read_only}: cannot write there: Read-only file system" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_bench_on_a_device_this_machine_lacks_is_one_line_before_any_run(tmp_path: Path) -> None:
    run = cli("bench", str(small_checkpoint(tmp_path)), "--device", "cuda", timeout=120)
    one_line_error(run, "device cuda: this torch sees no CUDA device")
    assert "run 1/" not in run.stderr + run.stdout


def test_bench_verify_and_drop(small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(small_model, model)
    assert main(["digest", str(model)]) == 0
    argv = ["bench", str(model), "--runs", "1", "--verify", "--drop", "--json", str(tmp_path / "v.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "sha256: " in err and "blake3 (format-2 blocks" in err and "GB/s on one core" in err
    rows = {r["loader"] for r in json.loads((tmp_path / "v.json").read_text())["rows"]}
    assert rows == {"streamload-mmap", "streamload-mmap+verify", "streamload-posix", "streamload-posix+verify"}


def test_bench_explains_itself(small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "streamload-mmap " in out and "runs here" in out and "does not run on cpu" in out
    model = tmp_path / "m"  # no digest file: --verify says what to run first, before any run
    shutil.copytree(small_model, model)
    assert main(["bench", str(model), "--verify", "--runs", "1"]) == 1
    assert f"run `streamload digest {model}` first" in capsys.readouterr().err
    assert main(["bench", str(model), "--sweep", "--loaders", "streamload-mmap"]) == 2
    assert "--sweep times streamload alone" in capsys.readouterr().err
    assert main(["digest", str(model)]) == 0  # one loader named: its verify row comes with it
    assert main(["bench", str(model), "--verify", "--runs", "1", "--loaders", "streamload-mmap"]) == 0
    out = capsys.readouterr().out
    assert "streamload-mmap+verify" in out and "streamload-posix" not in out


def test_server_warmup_example_prints_its_timeline_in_time_order() -> None:
    example = Path(__file__).parent.parent / "examples" / "server_warmup.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in out.stdout.splitlines() if " ms  " in line]
    times = [float(line.split(" ms", 1)[0]) for line in lines]
    assert times == sorted(times) and len(lines) >= 14
    assert "first request served" in lines[-1] and sum("loaded and warmed up" in line for line in lines) == 12


@pytest.mark.parametrize("url", ["hf://", "http://", "https://", "s3://", "s3:///"])
def test_a_url_with_nothing_after_its_scheme_is_one_line_naming_it(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamload: error:") and url.rstrip("/") in err[0], err


@pytest.mark.parametrize("port", ["70000", "65536", "-1", "http"])
def test_seed_port_out_of_range_is_a_usage_error_naming_it(
    tmp_path: Path, port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.commands.cli import _parser

    with pytest.raises(SystemExit) as info:  # parsed only: a port taken would start a seeder serving for ever
        _parser().parse_args(["seed", "--cache-dir", str(tmp_path), "--host", "127.0.0.1", "--port", port])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "--port" in err[0] and port in err[0], err


def _seed_fails_at_start(cache_dir: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """`streamload seed` on `cache_dir` on a free loopback port: what it said (a seeder that serves is
    killed by the timeout: it never ends on its own)."""
    return subprocess.run(
        [sys.executable, "-m", "streamload", "seed", "--cache-dir", str(cache_dir), "--host", "127.0.0.1",
         "--port", "0", *more],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_seed_refuses_a_cache_dir_that_is_no_folder_before_serving(tmp_path: Path, kind: str) -> None:
    cache = tmp_path / "cache"
    if kind == "file":
        cache.write_bytes(b"x")
    out = _seed_fails_at_start(cache)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and "serving" not in out.stdout, (out.stdout, out.stderr)
    assert len(err) == 1 and str(cache) in err[0] and err[0].startswith("streamload: error:"), err


@pytest.mark.parametrize(("rate", "says"), [("1", "unit"), ("200", "unit"), ("200B", "1 KB"), ("0.5KB", "1 KB")])
def test_seed_rate_needs_a_unit_and_at_least_a_kb_a_second(
    tmp_path: Path, rate: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamload.commands.cli import _parser

    with pytest.raises(SystemExit) as info:  # parsed only: a rate taken would start a seeder serving for ever
        _parser().parse_args(["seed", "--cache-dir", str(tmp_path), "--port", "0", "--rate", rate])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "--rate" in err[0] and says in err[0], err
    from streamload.commands.cli import _rate

    assert [_rate(r) for r in ("200MB", "50MiB", "1KB", "2 GB")] == [200_000_000, 50 << 20, 1000, 2_000_000_000]


def test_verbose_shows_the_info_lines_and_leaves_logging_as_it_was(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging

    logger = logging.getLogger("streamload")
    before = (logger.level, list(logger.handlers))
    assert main(["--verbose", "load", str(small_model), "--device", "cpu", "--reader", "posix"]) == 0
    err = capsys.readouterr().err
    assert "via posix into cpu" in err, err  # the load's INFO line
    assert (logger.level, list(logger.handlers)) == before
    assert main(["load", str(small_model), "--device", "cpu", "--reader", "posix"]) == 0
    assert "via posix into cpu" not in capsys.readouterr().err  # quiet by default


def test_reader_help_names_every_reader(capsys: pytest.CaptureFixture[str]) -> None:
    from streamload.pipeline.reader_choice import READERS

    with pytest.raises(SystemExit):
        main(["load", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    reader = text[text.rindex("--reader") : text.rindex("--cache-dir")]  # its entry, not the usage line
    assert "streamload." not in reader, reader  # user terms, not a module's name
    for name in ("auto", *(r.name for r in READERS)):
        assert re.search(rf"\b{name}\b", reader), (name, reader)


def test_demo_on_mapped_views_says_so_and_times_a_touch_of_every_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import streamload.commands.demo as demo

    small = Shape(vocab=256, hidden=64, intermediate=96, layers=2)
    monkeypatch.setattr(demo, "write_checkpoint", lambda directory: write_checkpoint(directory, small))
    demo.run(device="cpu", cold=False, keep=tmp_path / "demo")
    out = " ".join(capsys.readouterr().out.split())
    assert "via mmap" in out, out  # the CPU's default reader: tensors view the mapped files
    # a rate of views handed out is no read rate: the summary says they were mapped, and times a touch of each page
    assert not re.search(r"via mmap in [0-9.]+ s = [0-9.]+ GB/s", out), out
    assert "mapped" in out and re.search(r"touch\w* every page .*[0-9.]+ GB/s", out), out
