"""vLLM's compiled artifacts travel with the weights: published next to a checkpoint by a node that
compiled, installed by a starting node whose cache lacks them, before vLLM compiles.

vLLM keeps what torch.compile made under its cache root: `torch_compile_cache/<hash>/` (with AOT
compilation, `torch_compile_cache/torch_aot_compile/<hash>/`), `<hash>` its key for a model, its
configuration and environment. `publish` packs those folders into `streamload-compile-cache/<key>.tar`
beside the checkpoint, `<key>` naming what the artifacts need of a machine and vLLM's hash leaves out
(`node_key`). `install` fetches the archive for this node's key only (else it logs the keys published
and how they differ) and puts every `<hash>` folder the local cache lacks in place, each whole by a
rename; a folder the node has is never replaced, and vLLM uses an installed one only where its own
hash matches.

Installed artifacts run as code (vLLM imports generated Python and unpickles graphs), so nothing is
installed unless the user pinned the archive's digest, which `publish` prints (`pinned_digests.py`);
a pinned archive is still written member by member, never `extractall`-ed (`unpack.py`).

    streamload compile-cache publish path/to/model      # on a node that has compiled the model
    LLM(..., load_format="streamload", model_loader_extra_config={"compile_cache": "sha256:<hex>"})
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from streamload.base import atomic
from streamload.integrations.startup import pinned_digests
from streamload.integrations.startup.prefetch import COMPILE_CACHE, MODEL_INFOS, STAGED_INDEX, beside
from streamload.integrations.vllm.startup.recorded import CACHE, cache_root, recorded
from streamload.integrations.vllm.startup.unpack import unpack
from streamload.storage import redacted

log = logging.getLogger("vllm.streamload")

FOLDER = COMPILE_CACHE
INDEX = "index.json"


def node_key() -> dict[str, str]:
    """What a compiled artifact needs of the machine that runs it, beyond vLLM's own hash."""
    import torch
    import vllm

    from streamload.device import default_kind

    device = default_kind().fingerprint()  # "cuda sm_90", "cpu AVX512"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": "{}.{}".format(*sys.version_info[:2]),
            "machine": platform.machine(), "device": device}  # fmt: skip


def key_name(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def publish(checkpoint: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """Pack `root`'s (default: vLLM's cache root) compiled artifacts of `checkpoint` (`packed`) into its
    `streamload-compile-cache/<key>.tar` for this node's key, and list the key in its index.
    Written under a temporary name and renamed: a reader sees an archive whole or none."""
    source = Path(root) if root is not None else cache_root()
    if not (source / CACHE).is_dir() or not any((source / CACHE).iterdir()):
        raise FileNotFoundError(f"{source / CACHE}: no compiled artifacts to publish (run the engine once, compiled)")
    key = node_key()
    folder = Path(checkpoint) / FOLDER
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{key_name(key)}.tar"
    members = [(source / CACHE / name, f"{CACHE}/{name}") for name in packed(source, checkpoint)]
    try:
        _written(target, lambda f: _tar(f, members), sync=True)
        if (source / "modelinfos").is_dir():  # vLLM's model inspections: installed by the fetch started first
            _pack_model_infos(source / "modelinfos", Path(checkpoint) / MODEL_INFOS, _architectures(Path(checkpoint)))
        index = _read_index(folder / INDEX)
        index[key_name(key)] = key
        _written(folder / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())
    except BaseException:
        if made and not any(folder.iterdir()):  # a failed publish leaves no empty folder of its own behind
            folder.rmdir()
        raise
    return target


def _written(target: Path, data: bytes | Callable[[BinaryIO], object], sync: bool = False) -> None:
    """`atomic.write`, its failure (a full disk: `[Errno 28]`, with no file name) naming `target`."""
    try:
        atomic.write(target, data, sync=sync)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, f"{exc.strerror or exc} (publishing compiled artifacts)", str(target)) from exc


def install(
    source: str, pinned: frozenset[str], root: str | os.PathLike[str] | None = None, staged: Path | None = None
) -> str:
    """Fetch the archive published beside `source` for this node's key and, if its digest is one of
    `pinned`, install each of its compiled folders that `root` (default: vLLM's cache root) lacks.
    Returns what happened, in words (also logged); an archive of another digest raises
    `pinned_digests.Refused`. `staged`: where the fetch started with the process put the candidate
    archives before the weights (`prefetch.stage_compile_caches`): what it decided is taken from there."""
    if not pinned:
        raise ValueError(f"compiled artifacts beside {redacted(source)}: nothing pinned; {pinned_digests.HOW}")
    from streamload.storage import storage_for

    storage = storage_for(source)
    near = beside(source)
    key = node_key()
    name = key_name(key)
    ready = _read_index(staged / STAGED_INDEX) if staged is not None else {}
    if ready and name in ready.get("fetched", ()):
        data: bytes | None = (staged / f"{name}.tar").read_bytes()  # type: ignore[operator]
    elif ready and name not in ready.get("published", {}):
        data = None
    else:
        data = storage.sidecar(near, f"{FOLDER}/{name}.tar")
    if data is None:
        raw = None if ready else storage.sidecar(near, f"{FOLDER}/{INDEX}")
        published = ready.get("published", {}) if ready else (json.loads(raw) if raw else {})
        if published:
            differs = "; ".join(
                f"{k}: " + ", ".join(f"{f} {v!r}" for f, v in sorted(other.items()) if key.get(f) != v)
                for k, other in sorted(published.items())
            )
            said = f"no compiled artifacts published for this node ({key}); published: {differs}: compiling here"
        else:
            said = "no compiled artifacts published beside the checkpoint: compiling here"
        log.info("streamload: %s", said)
        return said
    where = f"{FOLDER}/{name}.tar beside {redacted(source)}"
    pinned_digests.check(data, pinned, f"compiled artifacts {where}")  # before a byte is unpacked
    added = _unpack(data, Path(root) if root is not None else cache_root(), where)
    said = f"installed {len(added)} compiled folder(s) published beside the checkpoint ({name})" if added else (
        "the compiled artifacts published beside the checkpoint are here already")  # fmt: skip
    log.info("streamload: %s", said)
    return said


def packed(root: str | os.PathLike[str] | None = None, checkpoint: str | os.PathLike[str] | None = None) -> list[str]:
    """The compiled folders `publish` packs from `root`, by name: those its engines recorded for
    `checkpoint` (recorded.py), else every one there (vLLM's names do not say which model they are)."""
    root = Path(root) if root is not None else cache_root()
    mine = recorded(checkpoint, root) if checkpoint is not None else []
    return mine or sorted(str(folder.relative_to(root / CACHE)) for folder in _compiled_folders(root / CACHE))


def _unpack(data: bytes, root: Path, what: str = "compiled artifacts") -> list[Path]:
    """Each compiled folder of the archive that `root` lacks, put in place whole (unpack.py)."""
    return unpack(data, root, lambda staging: _compiled_folders(staging / CACHE), what)


def _compiled_folders(cache: Path) -> list[Path]:
    if not cache.is_dir():
        return []
    out = []
    for entry in cache.iterdir():
        if entry.name == "torch_aot_compile" and entry.is_dir():
            out += [e for e in entry.iterdir() if e.is_dir()]
        elif entry.is_dir():
            out.append(entry)
    return out


def _architectures(checkpoint: Path) -> list[str]:
    """The model classes the checkpoint's config.json names (none where it has no readable one)."""
    try:
        names = json.loads((checkpoint / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str)]


def _pack_model_infos(folder: Path, target: Path, architectures: list[str]) -> None:
    """vLLM's inspections of this checkpoint's model classes only (`...-<Architecture>.json`), not
    those of every model the node ever ran."""
    if ours := [i for i in sorted(folder.glob("*.json")) if i.stem.rpartition("-")[2] in architectures]:
        _written(target, lambda f: _tar(f, [(info, f"modelinfos/{info.name}") for info in ours]))


def _tar(into: BinaryIO, members: list[tuple[Path, str]]) -> None:
    """A tar archive of each (path, name in the archive): readable by every user of the node that
    installs it (files 0644, folders 0755, owned by no one in particular), whatever they are here."""

    def shared(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mode = 0o755 if info.isdir() or info.mode & 0o100 else 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=into, mode="w") as tar:
        for path, name in members:
            tar.add(path, arcname=name, filter=shared)


def _read_index(path: Path) -> dict[str, dict[str, str]]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
