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
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload import device as devices
from streamload.base.errors import MissingFileError, SourceError, UnsupportedError
from streamload.format.dtypes import as_torch_dtype
from streamload.integrations.device_map import check_mapped
from streamload.nn.load_into import OnLayer, empty_weights, load_into
from streamload.plan.checkpoint import Checkpoint, merged, open_checkpoint
from streamload.storage.base import redacted
from streamload.storage.remote import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options

PIPELINE_INDEX = "model_index.json"
Dtype = torch.dtype | str | Mapping[str, torch.dtype | str] | None
DTypeOption = torch.dtype | Mapping[str, torch.dtype | str | None] | None  # streamload's dtype=, one model


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
    try:
        settings = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError):
        return None  # not diffusers' (transformers' loader names what is wrong with it)
    return "model" if isinstance(settings, dict) and "_class_name" in settings else None


def from_pretrained(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: Dtype = None,
    variant: str | None = None,
    on_layer: OnLayer | None = None,
    strict: bool = True,
    mapped: Collection[str] = (),
    **options: Unpack[Options],
) -> Any:
    """The `DiffusionPipeline` of a pipeline folder, or the model of a model folder (see the module's
    docstring); a folder in object storage (`s3://`, `http(s)://`) too. `dtype`: one dtype, or per
    component as diffusers takes it (`{"transformer": torch.bfloat16, "default": torch.float16}`);
    `variant`: the weight files' variant ("fp16"); `mapped`: the module names a device_map placed (each one of the
    model's, or of the pipeline's components: "text_encoder", "unet.down_blocks.0")."""
    try:
        import diffusers
    except ImportError:
        raise UnsupportedError(f"{redacted(path)} is a diffusers folder: pip install -e '.[diffusers]'") from None
    dev = devices.resolve(device)
    remote = is_url(str(path))
    with _Mirror(str(path), COMPONENT_FILES) if remote else contextlib.nullcontext() as mirror:
        folder = mirror.folder if mirror is not None else Path(path)

        def weights(component: str, model: nn.Module) -> Checkpoint:
            single_first = not isinstance(model, diffusers.ModelMixin)  # a transformers model
            if mirror is not None:
                return mirror.weights(component, variant, single_first)
            return _weights(folder / component if component else folder, variant, single_first)

        if _kind(folder) == "model":
            cls = _diffusers_class(diffusers, json.loads((folder / "config.json").read_text())["_class_name"], path)
            model, weights_dtype = _build(cls, folder, _dtype_of(dtype, ""))
            check_mapped(path, mapped, model)
            load_into(model, weights("", model), device=dev, dtype=weights_dtype, strict=strict, on_layer=on_layer,
                      **options)  # fmt: skip
            return model.to(dev).eval()
        index = json.loads((folder / PIPELINE_INDEX).read_text())
        pipeline_class = _diffusers_class(diffusers, index["_class_name"], f"{redacted(path)}/{PIPELINE_INDEX}")
        built: dict[str, nn.Module] = {}
        patterns: dict[str, torch.dtype | str | None] = {}
        for name, entry in index.items():
            if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
                continue
            _checked_name(name, path)
            cls = _component_class(diffusers, entry, name, path)
            if cls is not None:  # weights: built here (before any weight is read, so errors come first)
                built[name], weights_dtype = _build(cls, folder / name, _dtype_of(dtype, name))
                patterns |= _prefixed(name, weights_dtype)
        if built:
            holder = nn.Module()
            for name, model in built.items():
                holder.add_module(name, model)
            check_mapped(path, mapped, holder, "the pipeline's components")
            checkpoint = merged({name: weights(name, model) for name, model in built.items()})
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
        try:
            index = self._fetch("", PIPELINE_INDEX)
            entries = json.loads(index) if index else {}
            subs = [
                _checked_name(n, self.url) for n, e in entries.items() if not n.startswith("_") and isinstance(e, list)
            ]
            for sub in ["", *subs]:
                for name in ("config.json", *self.names):
                    self._fetch(sub, name)
        except BaseException:  # __exit__ is not called when __enter__ raises
            self._scratch.cleanup()
            raise
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

    def weights(self, component: str, variant: str | None, single_first: bool) -> Checkpoint:
        """A component's weights in object storage, chosen as in a local folder (`weight_names`)."""
        prefix = f"{self.url}/{component}" if component else self.url
        for name in weight_names(variant, single_first):
            if name.endswith(".json"):
                index = self.storage.sidecar(self._object(f"{prefix}/{name}"), name)
                if index is not None:
                    shards = sorted(set(json.loads(index).get("weight_map", {}).values()))
                    return open_checkpoint([f"{prefix}/{shard}" for shard in shards])
                continue
            try:
                return open_checkpoint(f"{prefix}/{name}")
            except MissingFileError:
                continue
        raise SourceError(f"{prefix}/: no safetensors weights ({' or '.join(_BASES)}, plain or {variant})")


def _diffusers_class(diffusers: Any, name: str, where: object) -> type:
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise UnsupportedError(f"{where}: this diffusers ({diffusers.__version__}) has no class {name!r}")
    return cls


_COMPONENT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # one folder's plain name: no "..", no "/"


def _checked_name(name: str, path: str | Path) -> str:
    """A component's name from the pipeline's index, which names its folder: refused unless a plain
    folder name (the index is the store's: it never chooses where a byte is read or written)."""
    if not _COMPONENT_NAME.fullmatch(name):
        raise UnsupportedError(f"{redacted(path)}/{PIPELINE_INDEX}: component {name!r} is not a plain folder name")
    return name


def _component_class(diffusers: Any, entry: list[Any], name: str, path: str | Path) -> type | None:
    """The class of a component that carries weights (a diffusers or transformers model), None for one
    that does not (diffusers loads those); a weighted component of another kind is refused by name."""
    library, class_name = entry if len(entry) == 2 else (entry, None)
    where = f"{redacted(path)}/{PIPELINE_INDEX}: component {name!r} ({library}.{class_name})"
    if library == "diffusers":
        home: Any = diffusers
    elif library == "transformers":
        import transformers

        home = transformers
    else:  # a pipeline module's own class (a safety checker): looked up among diffusers' pipelines
        home = getattr(diffusers.pipelines, library, None) if isinstance(library, str) else None
        if home is None:  # never imported by name: the checkpoint would choose what runs here
            raise UnsupportedError(f"{where}: streamload takes classes from diffusers and transformers only")
    cls = getattr(home, class_name, None) if isinstance(class_name, str) else None
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


def _build(cls: type, folder: Path, dtype: torch.dtype | None) -> tuple[nn.Module, DTypeOption]:
    """The model of `cls` from the folder's config, its parameters on meta, and the dtypes its weights
    take, as the model's own library chooses them (see `_diffusers_dtypes`; a transformers model's
    default is its config's)."""
    import diffusers

    if not (folder / "config.json").is_file():
        raise SourceError(f"{folder}: no config.json to build {cls.__name__} from")
    if issubclass(cls, diffusers.ModelMixin):
        config, unused = cls.load_config(folder, return_unused_kwargs=True)  # type: ignore[attr-defined]
        with empty_weights():
            model = cls.from_config(config, **unused)  # type: ignore[attr-defined]
        return model, _diffusers_dtypes(cls, dtype)
    import transformers

    from streamload.integrations import transformers_internals as internals

    config = cls.config_class.from_pretrained(folder)  # type: ignore[attr-defined]
    dtype = dtype or internals.default_dtype(transformers, config)
    with internals.no_init_weights(), empty_weights():  # transformers' switch first, as in .transformers
        model = cls._from_config(config, **({} if dtype is None else {"dtype": dtype}))  # type: ignore[attr-defined]
    internals.tied(model)
    return model, dtype


def _diffusers_dtypes(cls: type, dtype: torch.dtype | None) -> DTypeOption:
    """The dtypes diffusers' `from_pretrained` gives a model's floating-point weights: without
    `torch_dtype`, the dtype the model is built in (torch's default, float32: a bf16 checkpoint comes
    out float32); with it, that dtype, except the modules the class keeps in float32."""
    if dtype is None:
        return torch.get_default_dtype()
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    if not keep:
        return dtype
    # diffusers keeps a tensor in float32 when one of its name's parts is such a module
    kept: dict[str, torch.dtype] = {}
    for module in keep:
        kept |= {f"{module}.*": torch.float32, f"*.{module}.*": torch.float32}
    return {**kept, "*": dtype}


def _prefixed(component: str, dtype: DTypeOption) -> dict[str, torch.dtype | str | None]:
    """A component's dtype option as patterns over the pipeline's names (`component.parameter`)."""
    if dtype is None:
        return {}
    if isinstance(dtype, Mapping):
        return {f"{component}.{pattern}": d for pattern, d in dtype.items()}
    return {f"{component}.*": dtype}


def weight_names(variant: str | None, single_first: bool) -> list[str]:
    """The weight files a component's library looks for, in its order: the variant's, then the plain
    ones (the pipeline's fallback for a component without the variant). diffusers takes an index before
    a single file, transformers a single file before an index; what an index names is all that is read
    (a folder may hold a single file and the shards of another save side by side)."""
    names: list[str] = []
    for v in dict.fromkeys((variant, None)):
        for base in _BASES:
            single = [f"{base}.{v}.safetensors" if v else f"{base}.safetensors"]
            index = (
                [f"{base}.safetensors.index.{v}.json", f"{base}.{v}.safetensors.index.json"]
                if v
                else [f"{base}.safetensors.index.json"]
            )  # the second: diffusers' older name for a variant's index
            names += single + index if single_first else index + single
    return names


def _weights(folder: Path, variant: str | None, single_first: bool) -> Checkpoint:
    """A component's weights in a local folder, chosen as its library chooses them."""
    for name in weight_names(variant, single_first):
        if (folder / name).is_file():
            return open_checkpoint(folder / name)
    kind = f"{variant} or plain " if variant else ""
    raise SourceError(
        f"{folder}: no {kind}safetensors weights (diffusion_pytorch_model*.safetensors, model*.safetensors)"
    )


def _dtype_of(dtype: Dtype, component: str) -> torch.dtype | None:
    if isinstance(dtype, Mapping):
        dtype = dtype.get(component, dtype.get("default"))
    return None if dtype is None else as_torch_dtype(dtype)
