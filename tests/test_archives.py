"""Archives from the store are read member by member as data, never `extractall`-ed: vLLM's model
inspections (`prefetch.install_model_infos`, run by the fetch every engine start begins) and the pinned
compiled artifacts (`integrations/vllm/startup/compiled.py`). Each crafted archive below escaped, or
failed the load, through `tarfile.extractall(filter="data")` on a Python without the CVE-2025-4517 fix
(3.11.7 here); now nothing of it lands outside `modelinfos/<name>.json` (or the compiled folders), and
the plain members beside it still install."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import stat
import tarfile
import time
from pathlib import Path

import pytest

from streamload.integrations.startup import pinned_digests as pins
from streamload.integrations.startup import prefetch
from streamload.integrations.vllm.startup import compiled

LLAMA = "vllm-models-llama-LlamaForCausalLM.json"
QWEN = "vllm-models-qwen2-Qwen2ForCausalLM.json"
INFO = b'{"hash": "h", "modelinfo": {"architecture": "LlamaForCausalLM", "supports_pp": true}}'
QWEN_INFO = b'{"hash": "h", "modelinfo": {"architecture": "Qwen2ForCausalLM", "supports_pp": true}}'
PAYLOAD = b"import os; os.system('echo pwned')\n"
BOMB = 64 << 20  # bytes a gzip bomb inflates to (from about 64 KiB)

Member = tuple[tarfile.TarInfo, bytes | None]


def _file(name: str, data: bytes, mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _special(name: str, kind: bytes, target: str = "") -> Member:
    """A member of tar type `kind` (a folder, a link to `target`, a device, a FIFO)."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, target, 0o755 if kind == tarfile.DIRTYPE else 0o644
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3  # /dev/null's numbers
    return info, None


def _tar(members: list[Member]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _chain(up: int, payload: str) -> list[Member]:
    """The CVE-2025-4517 pattern: nested folders of long names reached through short links, so that
    `os.path.realpath` overflows PATH_MAX and stops resolving, which the "data" filter relies on; a
    last link beyond that points back up, and `escape` through it to `up` folders above the folder
    unpacked into, where `payload` is then written."""
    long, steps, path, out = "d" * 247, "abcdefghijklmnop", "", []
    for step in steps:
        out += [
            _special(os.path.join(path, long), tarfile.DIRTYPE),
            _special(os.path.join(path, step), tarfile.SYMTYPE, long),
        ]
        path = os.path.join(path, long)
    deep = os.path.join("/".join(steps), "l" * 254)
    out.append(_special(deep, tarfile.SYMTYPE, "../" * len(steps)))
    out.append(_special("escape", tarfile.SYMTYPE, deep + "/.." * up))
    return [*out, _file(f"escape/{payload}", PAYLOAD)]


class _Zeros(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        buffer[:] = bytes(len(buffer))
        return len(buffer)


def _gzip_bomb() -> bytes:
    """A gzip-compressed tar of a plain inspection and BOMB bytes of zeros (about a thousandth of that)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=9) as tar:
        info, data = _file(f"modelinfos/{LLAMA}", INFO)
        tar.addfile(info, io.BytesIO(data))
        zeros = tarfile.TarInfo(f"modelinfos/{QWEN}")
        zeros.size = BOMB
        tar.addfile(zeros, io.BufferedReader(_Zeros()))
    return out.getvalue()


def _crafted(tmp_path: Path, case: str) -> list[Member]:
    """The members of each crafted archive (put between two plain inspections)."""
    user = tmp_path / "home" / ".bashrc"  # a file of the user's, outside the cache
    return {
        "symlink chain past PATH_MAX": _chain(1, "torch_compile_cache/0123abcd/PWNED.py"),  # into the cache root
        "../ name": [_file("modelinfos/../../../PWNED.json", INFO), _file("../PWNED.py", PAYLOAD)],
        "absolute name": [_file(str(tmp_path / "home" / "PWNED.json"), INFO)],
        "hard link": [_special("modelinfos/x-Hard.json", tarfile.LNKTYPE, str(user))],
        "device and FIFO": [
            _special("modelinfos/x-Dev.json", tarfile.CHRTYPE),
            _special("modelinfos/x-Fifo.json", tarfile.FIFOTYPE),
        ],
        "symlink to /": [
            _special("modelinfos/x-Root.json", tarfile.SYMTYPE, "/"),
            _special("root", tarfile.SYMTYPE, "/"),
            _file(f"root/{str(tmp_path)[1:]}/home/PWNED.py", PAYLOAD),
        ],
    }[case]


CASES = ["symlink chain past PATH_MAX", "../ name", "absolute name", "hard link", "device and FIFO", "symlink to /"]
CACHE = "home/.cache/vllm"
INSTALLED = {"home/.cache", CACHE, f"{CACHE}/modelinfos", f"{CACHE}/modelinfos/{LLAMA}", f"{CACHE}/modelinfos/{QWEN}"}


def _everything(top: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `top` (links not followed): its type, and a file's size and link count."""
    out = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            kind = stat.S_IFMT(st.st_mode)
            out[os.path.relpath(os.path.join(folder, name), top)] = (kind, 0, 0) if kind == stat.S_IFDIR else (
                kind, st.st_size, st.st_nlink)  # fmt: skip
    return out


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home (a file of the user's in it) holding vLLM's cache root (not made yet), and a model folder
    beside it: the cache root."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("the user's own\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"]}')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / CACHE))
    return tmp_path / CACHE


def _publish(model: Path, data: bytes) -> None:
    (model / prefetch.MODEL_INFOS).parent.mkdir(exist_ok=True)
    (model / prefetch.MODEL_INFOS).write_bytes(data)


def _plain_around(members: list[Member]) -> bytes:
    return _tar([_file(f"modelinfos/{LLAMA}", INFO), *members, _file(f"modelinfos/{QWEN}", QWEN_INFO)])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "streamload" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_inspections_archive_installs_only_its_plain_inspections(
    case: str, node: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever an archive holds between two plain inspections, those two install and nothing else
    lands anywhere (the whole tree, home included, compared before and after); the call returns, with
    one warning naming the archive and how many members it skipped."""
    members = _crafted(tmp_path, case)
    _publish(tmp_path / "model", _plain_around(members))
    before = _everything(tmp_path)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(tmp_path / "model")) == 2
    after = _everything(tmp_path)
    assert set(after) - set(before) == INSTALLED
    assert {p: after.get(p) for p in before} == before  # nothing there changed (nor was linked to)
    assert (node / "modelinfos" / LLAMA).read_bytes() == INFO and (node / "modelinfos" / QWEN).read_bytes() == QWEN_INFO
    said = f"{prefetch.MODEL_INFOS} beside {tmp_path / 'model'}: {len(members)} member(s) skipped"
    assert len(_warnings(caplog)) == 1 and said in _warnings(caplog)[0], _warnings(caplog)


def test_a_compressed_archive_is_never_inflated(node: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A gzip bomb (a thousandfold) is not opened: only uncompressed archives are read, as `publish`
    writes them; nothing of it installs, one warning says why, and the call returns."""
    _publish(tmp_path / "model", _gzip_bomb())
    assert len((tmp_path / "model" / prefetch.MODEL_INFOS).read_bytes()) < BOMB // 500
    before = _everything(tmp_path)
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(tmp_path / "model")) == 0
    assert _everything(tmp_path) == before
    assert len(_warnings(caplog)) == 1 and "is not an uncompressed tar archive" in _warnings(caplog)[0]


def test_inspections_are_capped_and_never_replace_nor_write_through_a_link(
    node: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An inspection over 64 KiB and the members after the first 256 are skipped (one warning); one
    the node has is kept; a `modelinfos` that is a link (another user's, in a shared cache) is not
    written through."""
    big = b'{"hash": "h", "modelinfo": {"architecture": "Big", "x": "' + b"y" * (1 << 16) + b'"}}'
    classes = [f"M{k:03}" for k in range(300)]
    many = [_file(f"modelinfos/x-{c}.json", INFO.replace(b"LlamaForCausalLM", c.encode())) for c in classes]
    _publish(tmp_path / "model", _tar([_file("modelinfos/x-Big.json", big), *many]))
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["Big", *classes]}))
    (node / "modelinfos").mkdir(parents=True)
    (node / "modelinfos" / "x-M001.json").write_text("its own")
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(tmp_path / "model")) == 254  # 256 read: big, M000..M254
    assert sorted(p.name for p in (node / "modelinfos").iterdir()) == [f"x-{c}.json" for c in classes[:255]]
    assert (node / "modelinfos" / "x-M001.json").read_text() == "its own"
    said = "1 member(s) and those after the first 256 skipped"
    assert len(_warnings(caplog)) == 1 and said in _warnings(caplog)[0], _warnings(caplog)

    shutil.rmtree(node / "modelinfos")
    (tmp_path / "elsewhere").mkdir()
    (node / "modelinfos").symlink_to(tmp_path / "elsewhere")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="streamload"):
        assert prefetch.install_model_infos(str(tmp_path / "model")) == 0
    assert not any((tmp_path / "elsewhere").iterdir())
    assert len(_warnings(caplog)) == 2 and f"not installed: {node / 'modelinfos'}" in _warnings(caplog)[1]


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_fetch_every_engine_start_begins_installs_only_plain_inspections(
    node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: `prefetch.ahead` (what streamload's vLLM start-up calls first) fetches the archive
    of the symlink chain beside the weights: its two inspections install, nothing else lands."""
    _publish(tmp_path / "model", _plain_around(_chain(1, "torch_compile_cache/0123abcd/PWNED.py")))
    before = _everything(tmp_path)
    monkeypatch.delenv(prefetch.ENV, raising=False)
    started = prefetch.ahead(str(tmp_path / "model"))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    try:
        assert prefetch.wait(Path(started["done"]), started["pid"], timeout=60)["ok"]
    finally:
        deadline = time.monotonic() + 10
        while not _ended(started["pid"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        shutil.rmtree(Path(started["done"]).parent, ignore_errors=True)
    after = _everything(tmp_path)
    assert set(after) - set(before) == INSTALLED and {p: after.get(p) for p in before} == before


def _compiled_archive(*members: Member) -> bytes:
    """A compiled folder as `publish` packs it, around `members`."""
    return _tar([
        _special("torch_compile_cache/bb22", tarfile.DIRTYPE),
        *members,
        _file("torch_compile_cache/bb22/rank_0_0/backbone/computation_graph.py", b"graph"),
    ])  # fmt: skip


REFUSED = {
    "symlink chain past PATH_MAX": (_chain(1, "torch_compile_cache/0123abcd/PWNED.py"), "'a' is a symbolic link"),
    "link in the folder": ([_special("torch_compile_cache/bb22/up", tarfile.SYMTYPE, "../..")], "is a symbolic link"),
    "../ name": ([_file("torch_compile_cache/../../PWNED.py", PAYLOAD)], "is not a plain relative name"),
    "absolute name": ([_file("/tmp/PWNED.py", PAYLOAD)], "is not a plain relative name"),
    "hard link": ([_special("torch_compile_cache/x", tarfile.LNKTYPE, "/etc/passwd")], "is a hard link"),
    "FIFO": ([_special("torch_compile_cache/bb22/f", tarfile.FIFOTYPE)], "is a FIFO"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_pinned_compiled_archive_holding_anything_but_files_and_folders_is_refused_whole(
    case: str, tmp_path: Path
) -> None:
    """Pinned compiled artifacts are written member by member too: an archive holding a link, a
    device, a FIFO, or a name leaving its folder is not what `publish` packs, and is refused whole
    (a ValueError naming the member) before a byte of it is written: nothing lands anywhere."""
    members, said = REFUSED[case]
    root = tmp_path / "home" / ".cache" / "vllm"
    root.mkdir(parents=True)
    before = _everything(tmp_path)
    with pytest.raises(ValueError, match=f"{said}.*only files and folders are unpacked; nothing of it was installed"):
        compiled._unpack(_compiled_archive(*members), root)
    assert _everything(tmp_path) == before


def test_a_pinned_compiled_archive_installs_its_files_and_folders_readable_by_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `install` with its pin: the files and folders (names as GNU tar writes them, `./`
    first, included) are written one by one, files 0644 (0755 where executable) and folders 0755
    whatever the archive or umask says; a crafted one is refused naming the archive."""
    pytest.importorskip("vllm")
    model = tmp_path / "model"
    (model / compiled.FOLDER).mkdir(parents=True)
    archive = model / compiled.FOLDER / f"{compiled.key_name(compiled.node_key())}.tar"
    archive.write_bytes(_tar([
        _special("./", tarfile.DIRTYPE),
        _special("./torch_compile_cache/", tarfile.DIRTYPE),
        _file("./torch_compile_cache/torch_aot_compile/aa11/rank_0_0/model", b"model", 0o600),
        _file("./torch_compile_cache/torch_aot_compile/aa11/run", b"#!/bin/sh\n", 0o4700),
    ]))  # fmt: skip
    root = tmp_path / "root"
    said = compiled.install(str(model), frozenset({pins.digest(archive.read_bytes())}), root)
    assert "installed 1 compiled folder(s)" in said
    aa11 = root / "torch_compile_cache" / "torch_aot_compile" / "aa11"
    assert (aa11 / "rank_0_0" / "model").read_bytes() == b"model"
    modes = {str(p.relative_to(aa11)): stat.S_IMODE(p.stat().st_mode) for p in [aa11, *aa11.rglob("*")]}
    assert modes == {".": 0o755, "rank_0_0": 0o755, "rank_0_0/model": 0o644, "run": 0o755}
    assert sorted(p.name for p in root.iterdir()) == ["torch_compile_cache"]  # no staging left

    archive.write_bytes(_compiled_archive(*REFUSED["symlink chain past PATH_MAX"][0]))
    shutil.rmtree(root)
    with pytest.raises(ValueError, match=f"{compiled.FOLDER}/{archive.name} beside {model}: member 'a' is a symbolic"):
        compiled.install(str(model), frozenset({pins.digest(archive.read_bytes())}), root)
    assert not root.exists() or not any(root.rglob("*"))
