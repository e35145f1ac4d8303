"""diffusers: a pipeline folder (`model_index.json`) or a model folder (`config.json` with `_class_name`)
-> the pipeline or model, every component's weights streamed in one load.

diffusers has no loader plug-in point, so streamload builds what carries weights itself: each
`ModelMixin` component from its config and each `transformers` component from its own (both with
parameters on meta), then streams the files of all of them as one checkpoint (one ring, one reader
pool, layer by layer across components: the largest does not wait for the smallest), named
`component.parameter`. The components without weights (schedulers, tokenizers, feature extractors)
are left to diffusers' own `from_pretrained`, which is handed the built components.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload import device as devices
from streamload.dtypes import as_torch_dtype
from streamload.errors import MissingFileError, SourceError, UnsupportedError
from streamload.module import OnLayer, empty_weights, load_into
from streamload.source import Checkpoint, merged, open_checkpoint
from streamload.storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.api import Options

PIPELINE_INDEX = "model_index.json"
Dtype = torch.dtype | str | Mapping[str, torch.dtype | str] | None


def kind(source: str | Path) -> str | None:
    """ "pipeline" for a pipeline folder or prefix, "model" for a diffusers model's, else None."""
    if is_url(str(source)):
        with _Mirror(str(source), ()) as mirror:
            return mirror.kind()
    return _kind(Path(source))


def _kind(folder: Path) -> str | None:
    if (folder / PIPELINE_INDEX).is_file():
        return "pipeline"
    config = folder / "config.json"
    return "model" if config.is_file() and "_class_name" in json.loads(config.read_text()) else None


def from_pretrained(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: Dtype = None,
    variant: str | None = None,
    on_layer: OnLayer | None = None,
    strict: bool = True,
    **options: Unpack[Options],
) -> Any:
    """The `DiffusionPipeline` of a pipeline folder, or the model of a model folder (see the module's
    docstring); a folder in object storage (`s3://`, `http(s)://`) too. `dtype`: one dtype, or per
    component as diffusers takes it (`{"transformer": torch.bfloat16, "default": torch.float16}`);
    `variant`: the weight files' variant ("fp16")."""
    try:
        import diffusers
    except ImportError:
        raise UnsupportedError(f"{path} is a diffusers folder: pip install -e '.[diffusers]'") from None
    dev = devices.resolve(device)
    remote = is_url(str(path))
    with _Mirror(str(path), COMPONENT_FILES) if remote else contextlib.nullcontext() as mirror:
        folder = mirror.folder if mirror is not None else Path(path)

        def weights(component: str) -> Checkpoint:
            if mirror is not None:
                return mirror.weights(component, variant)
            return _weights(folder / component if component else folder, variant)

        if _kind(folder) == "model":
            cls = _diffusers_class(diffusers, json.loads((folder / "config.json").read_text())["_class_name"], path)
            model, weights_dtype = _build(cls, folder, _dtype_of(dtype, ""))
            load_into(model, weights(""), device=dev, dtype=weights_dtype, strict=strict, on_layer=on_layer,
                      **options)  # fmt: skip
            return model.to(dev).eval()
        index = json.loads((folder / PIPELINE_INDEX).read_text())
        pipeline_class = _diffusers_class(diffusers, index["_class_name"], f"{path}/{PIPELINE_INDEX}")
        built: dict[str, nn.Module] = {}
        dtypes: dict[str, torch.dtype] = {}
        for name, entry in index.items():
            if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
                continue
            cls = _component_class(diffusers, entry, name, path)
            if cls is not None:  # weights: built here (before any weight is read, so errors come first)
                built[name], weights_dtype = _build(cls, folder / name, _dtype_of(dtype, name))
                if weights_dtype is not None:
                    dtypes[name] = weights_dtype
        if built:
            holder = nn.Module()
            for name, model in built.items():
                holder.add_module(name, model)
            checkpoint = merged({name: weights(name) for name in built})
            patterns = {f"{name}.*": d for name, d in dtypes.items()}
            load_into(holder, checkpoint, device=dev, dtype=patterns or None, strict=strict, on_layer=on_layer,
                      **options)  # fmt: skip
            for model in built.values():
                model.to(dev).eval()  # the buffers the constructors made on the CPU
        torch_dtype = dtype if dtype is None or isinstance(dtype, Mapping) else as_torch_dtype(dtype)
        return pipeline_class.from_pretrained(folder, **built, torch_dtype=torch_dtype)


# What a component folder may hold besides weights (configs, tokenizers, schedulers, feature extractors):
# fetched from object storage by name (an HTTP server cannot be listed), absent ones skipped.
COMPONENT_FILES = (
    "config.json", "generation_config.json", "scheduler_config.json", "preprocessor_config.json",
    "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja",
)  # fmt: skip
_BASES = ("diffusion_pytorch_model", "model")


class _Mirror:
    """A pipeline or model folder in object storage, its small files copied into a temporary folder (for
    the configs and for diffusers' loading of what has no weights); the weights stay there, streamed."""

    def __init__(self, url: str, names: tuple[str, ...]) -> None:
        from streamload.storage import storage_for
        from streamload.storage.remote import ObjectPath

        self.url, self.names = url.rstrip("/"), names
        self.storage = storage_for(self.url + "/")
        self._object = ObjectPath

    def __enter__(self) -> _Mirror:
        self._scratch = tempfile.TemporaryDirectory(prefix="streamload-diffusers-")
        self.folder = Path(self._scratch.name)
        index = self._fetch("", PIPELINE_INDEX)
        components = (
            [n for n, e in json.loads(index).items() if not n.startswith("_") and isinstance(e, list)] if index else []
        )
        for sub in ["", *components]:
            for name in ("config.json", *self.names):
                self._fetch(sub, name)
        return self

    def __exit__(self, *exc: object) -> None:
        self._scratch.cleanup()

    def kind(self) -> str | None:
        return _kind(self.folder)

    def _fetch(self, sub: str, name: str) -> bytes | None:
        near = self._object(f"{self.url}/{sub}/{name}" if sub else f"{self.url}/{name}")
        data = self.storage.sidecar(near, name)
        if data is not None:
            target = self.folder / sub / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return data

    def weights(self, component: str, variant: str | None) -> Checkpoint:
        """A component's weights in object storage: by its index (variant first), else its single file."""
        prefix = f"{self.url}/{component}" if component else self.url
        for v in dict.fromkeys((variant, None)):
            for base in _BASES:
                index_name = f"{base}.safetensors.index.{v}.json" if v else f"{base}.safetensors.index.json"
                index = self.storage.sidecar(self._object(f"{prefix}/{index_name}"), index_name)
                if index is not None:
                    shards = sorted(set(json.loads(index).get("weight_map", {}).values()))
                    return open_checkpoint([f"{prefix}/{shard}" for shard in shards])
                try:
                    return open_checkpoint(f"{prefix}/{base}.{v}.safetensors" if v else f"{prefix}/{base}.safetensors")
                except MissingFileError:
                    continue
        raise SourceError(f"{prefix}/: no safetensors weights ({' or '.join(_BASES)}, plain or {variant})")


def _diffusers_class(diffusers: Any, name: str, where: object) -> type:
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise UnsupportedError(f"{where}: this diffusers ({diffusers.__version__}) has no class {name!r}")
    return cls


def _component_class(diffusers: Any, entry: list[Any], name: str, path: str | Path) -> type | None:
    """The class of a component that carries weights (a diffusers or transformers model), None for one
    that does not (diffusers loads those); a weighted component of another kind is refused by name."""
    library, class_name = entry
    if library == "diffusers":
        cls = getattr(diffusers, class_name, None)
    elif library == "transformers":
        import transformers

        cls = getattr(transformers, class_name, None)
    else:  # a pipeline module's own class (a safety checker) or another library's
        module = getattr(diffusers.pipelines, library, None)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is None:
            try:
                cls = getattr(__import__(library), class_name, None)
            except ImportError:
                cls = None
    where = f"{path}/{PIPELINE_INDEX}: component {name!r} ({library}.{class_name})"
    if cls is None:
        raise UnsupportedError(f"{where}: no such class is installed")
    if _is_model(cls, diffusers):
        return cls
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        raise UnsupportedError(f"{where}: streamload builds diffusers and transformers models only")
    return None


def _is_model(cls: Any, diffusers: Any) -> bool:
    if not isinstance(cls, type):
        return False
    if issubclass(cls, diffusers.ModelMixin):
        return True
    try:
        import transformers
    except ImportError:
        return False
    return issubclass(cls, transformers.PreTrainedModel)


def _build(cls: type, folder: Path, dtype: torch.dtype | None) -> tuple[nn.Module, torch.dtype | None]:
    """The model of `cls` from the folder's config, its parameters on meta, and the dtype its weights
    take (a transformers model's default is its config's, as transformers chooses it)."""
    import diffusers

    if not (folder / "config.json").is_file():
        raise SourceError(f"{folder}: no config.json to build {cls.__name__} from")
    if issubclass(cls, diffusers.ModelMixin):
        config, unused = cls.load_config(folder, return_unused_kwargs=True)  # type: ignore[attr-defined]
        with empty_weights():
            model = cls.from_config(config, **unused)  # type: ignore[attr-defined]
        return model, dtype
    import transformers

    from .transformers import default_dtype, skipped_init, tied

    config = cls.config_class.from_pretrained(folder)  # type: ignore[attr-defined]
    dtype = dtype or default_dtype(transformers, config)
    with skipped_init(transformers), empty_weights():  # transformers' switch first, as in .transformers
        model = cls._from_config(config, **({} if dtype is None else {"dtype": dtype}))  # type: ignore[attr-defined]
    tied(model)
    return model, dtype


# diffusion_pytorch_model[.fp16][-00001-of-00002].safetensors, model[.fp16][-00001-of-00002].safetensors
_WEIGHTS = re.compile(r"^(?P<base>[^.]+?)(?:\.(?P<variant>[^.-]+))?(?:-\d+-of-\d+)?\.safetensors$")


def _weights(folder: Path, variant: str | None) -> Checkpoint:
    """A component's safetensors files: those of `variant` where it has them, else the plain ones."""
    files = {v: [] for v in (variant, None)}  # type: dict[str | None, list[Path]]
    for f in sorted(folder.glob("*.safetensors")):
        match = _WEIGHTS.match(f.name)
        if match and match["variant"] in files:
            files[match["variant"]].append(f)
    chosen = files[variant] or files[None]
    if not chosen:
        kind = f"{variant} or plain " if variant else ""
        raise SourceError(
            f"{folder}: no {kind}safetensors weights (diffusion_pytorch_model*.safetensors, model*.safetensors)"
        )
    return open_checkpoint(chosen)


def _dtype_of(dtype: Dtype, component: str) -> torch.dtype | None:
    if isinstance(dtype, Mapping):
        dtype = dtype.get(component, dtype.get("default"))
    return None if dtype is None else as_torch_dtype(dtype)
