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
import os
import re
import sys
import tempfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from streamload.base.errors import MissingFileError, SourceError, UnsupportedError
from streamload.device import resolve
from streamload.format.dtypes import as_torch_dtype
from streamload.integrations import transformers_internals
from streamload.integrations.device_map import check_mapped
from streamload.nn.load_into import OnLayer, empty_weights, load_into
from streamload.plan.checkpoint import Checkpoint, merged, open_checkpoint
from streamload.storage import Storage, storage_for
from streamload.storage.base import parse_index, redacted
from streamload.storage.remote import ObjectPath, is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options

PIPELINE_INDEX = "model_index.json"
Dtype = torch.dtype | str | Mapping[str, torch.dtype | str] | None
DTypeOption = torch.dtype | Mapping[str, torch.dtype | str | None] | None  # streamload's dtype=, one model


def kind(source: str | os.PathLike[str]) -> str | None:
    """ "pipeline" for a pipeline folder or prefix, "model" for a diffusers model's, else None."""
    if is_url(str(source)):
        with _mirror(str(source).rstrip("/"), ()) as (folder, _):
            return _kind(folder)
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
    """`streamload.from_pretrained` for a diffusers pipeline or model folder (or its object-storage prefix), the
    arguments as documented there; `mapped`: the module names a device_map placed (each one of the model's, or
    of the pipeline's components: "text_encoder", "unet.down_blocks.0")."""
    try:
        import diffusers
    except ImportError:
        raise UnsupportedError(f"{redacted(path)} is a diffusers folder: pip install -e '.[diffusers]'") from None
    dev = resolve(device)
    url = str(path).rstrip("/") if is_url(str(path)) else None
    with _mirror(url, COMPONENT_FILES) if url else contextlib.nullcontext((Path(path), None)) as (folder, storage):

        def weights(component: str, model: nn.Module) -> Checkpoint:
            single_first = not isinstance(model, diffusers.ModelMixin)  # a transformers model
            if url is not None:
                return _stored_weights(storage, f"{url}/{component}" if component else url, variant, single_first)
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
            holder = nn.ModuleDict(built)
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


@contextlib.contextmanager
def _mirror(url: str, names: tuple[str, ...]) -> Iterator[tuple[Path, Storage]]:
    """A pipeline or model folder in object storage, its small files copied into a temporary folder (for
    the configs and for diffusers' loading of what has no weights), and its storage: the weights stay there."""
    storage = storage_for(url + "/")
    with tempfile.TemporaryDirectory(prefix="streamload-diffusers-") as scratch:

        def fetch(sub: str, name: str) -> bytes | None:
            data = storage.sidecar(ObjectPath(f"{url}/{sub}/{name}" if sub else f"{url}/{name}"), name)
            if data is not None:
                Path(scratch, sub).mkdir(parents=True, exist_ok=True)
                Path(scratch, sub, name).write_bytes(data)
            return data

        index = fetch("", PIPELINE_INDEX)
        entries = json.loads(index) if index else {}
        subs = [_checked_name(n, url) for n, e in entries.items() if not n.startswith("_") and isinstance(e, list)]
        for sub in ["", *subs]:
            for name in ("config.json", *names):
                fetch(sub, name)
        yield Path(scratch), storage


def _stored_weights(storage: Storage, prefix: str, variant: str | None, single_first: bool) -> Checkpoint:
    """A component's weights in object storage, chosen as in a local folder (`weight_names`)."""
    for name in weight_names(variant, single_first):
        if not name.endswith(".json"):
            try:
                return open_checkpoint(f"{prefix}/{name}")
            except MissingFileError:
                continue
        elif (index := storage.sidecar(near := ObjectPath(f"{prefix}/{name}"), name)) is not None:
            # parse_index refuses a shard that is no plain file name: the store's index chooses no other object
            shards = parse_index(near, index.decode("utf-8", "replace")).files
            return open_checkpoint([f"{prefix}/{shard.name}" for shard in shards])
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
        import transformers as home
    else:  # a pipeline module's own class (a safety checker): looked up among diffusers' pipelines
        home = getattr(diffusers.pipelines, library, None) if isinstance(library, str) else None
        if home is None:  # never imported by name: the checkpoint would choose what runs here
            raise UnsupportedError(f"{where}: streamload takes classes from diffusers and transformers only")
    cls = getattr(home, class_name, None) if isinstance(class_name, str) else None
    if cls is None:
        raise UnsupportedError(f"{where}: no such class is installed")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return None  # no weights (a scheduler, a tokenizer): diffusers loads it
    transformers = sys.modules.get("transformers")  # imported where a class of its models is
    if not issubclass(cls, (diffusers.ModelMixin, *([transformers.PreTrainedModel] if transformers else []))):
        raise UnsupportedError(f"{where}: streamload builds diffusers and transformers models only")
    return cls


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

    transformers_internals.check_version(transformers)
    config = cls.config_class.from_pretrained(folder)  # type: ignore[attr-defined]
    dtype = dtype or transformers_internals.config_dtype(config)
    with transformers_internals.no_init_weights(), empty_weights():  # transformers' switch first, as in .transformers
        model = cls._from_config(config, **({} if dtype is None else {"dtype": dtype}))  # type: ignore[attr-defined]
    return transformers_internals.tied(model), dtype


def _diffusers_dtypes(cls: type, dtype: torch.dtype | None) -> DTypeOption:
    """The dtypes diffusers' `from_pretrained` gives a model's floating-point weights: without
    `torch_dtype`, the dtype the model is built in (torch's default, float32: a bf16 checkpoint comes
    out float32); with it, that dtype, except the modules the class keeps in float32."""
    if dtype is None:
        return torch.get_default_dtype()
    # diffusers keeps a tensor in float32 when one of its name's parts is such a module
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    kept = {pattern: torch.float32 for m in keep for pattern in (f"{m}.*", f"*.{m}.*")}
    return {**kept, "*": dtype} if kept else dtype


def _prefixed(component: str, dtype: DTypeOption) -> dict[str, torch.dtype | str | None]:
    """A component's dtype option as patterns over the pipeline's names (`component.parameter`)."""
    patterns = dtype if isinstance(dtype, Mapping) else {} if dtype is None else {"*": dtype}
    return {f"{component}.{pattern}": d for pattern, d in patterns.items()}


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
