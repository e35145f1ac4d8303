"""streamload as a vLLM load format: `LLM(model, load_format="streamload")`, `vllm serve M --load-format streamload`.

`pip install -e ".[vllm]"` registers the format through vLLM's `vllm.general_plugins` entry
point, in every vLLM process; user code imports nothing. Options come as `model_loader_extra_config`
(`OPTIONS`). The loader:

1. resolves the checkpoint as vLLM's default loader does (a local directory, a hub id downloaded into
   vLLM's download dir, the object-storage `model_weights` vLLM pulled configs for), or `source`;
2. learns, by a dry run of the model's own `load_weights` on stand-ins (`dryrun.py`), which part of
   each tensor this tensor-parallel rank keeps and which parameter view it lands in (a layer like one
   the dry run saw is not dry-run: it loads as that layer's twin, `twins.py`);
3. streams only those bytes, in layer order, straight into the parameters (`iter(shard=, into=)`);
   tensors the dry run could not predict are read whole and go through `load_weights` as usual.

`get_all_weights` streams whole tensors in layer order, which is what vLLM's in-place
`reload_weights(weights_path=...)` asks a loader for.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import weakref
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping
from contextlib import closing, contextmanager, nullcontext
from copy import copy as shallow_copy
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import (
    filter_safetensors_files_by_weight_name,
    pt_weights_iterator,
)

from streamload import api, arguments, pins, prefetch
from streamload import device as devices
from streamload.collector import collector_paused
from streamload.dtypes import torch_shape
from streamload.errors import StreamloadError, UnsupportedError
from streamload.format import TensorInfo
from streamload.plan import converts, ordered
from streamload.shard import SKIP, ShardSpec, Slice
from streamload.source import Checkpoint, open_checkpoint
from streamload.stats import Stats

from . import ahead, overlap, restore, twins
from .dryrun import Copy, Diverged, Learned, Replay, dry_run, replay

log = logging.getLogger("vllm.streamload")  # under vLLM's logger: shown with vLLM's own lines


@dataclass
class Report:
    """What the last load in this process did (`last_load`): for logs, tests and benchmarks."""

    seconds: float = 0.0
    plan_seconds: float = 0.0  # of which: headers and the dry run, before the first byte is read
    bytes_read: int = 0
    reader: str = ""  # the reader the streams used ("mmap", "posix", "kvikio", "range", ...)
    bytes_total: int = 0  # the whole checkpoint
    direct: int = 0  # tensors written straight into their parameters
    by_twin: int = 0  # of which placed as a dry-run layer's twin (twins.py)
    through_model: int = 0  # tensors read whole and given to the model's load_weights
    unused: int = 0  # tensors the model does not use: never read
    bytes_fair: int = 0  # 1/world of each tensor the ranks split plus every other tensor read: the goal
    staged: str = ""  # where the first load read weights fetched while the engine started (ahead.py)
    compile_cache: str = ""  # what the first load did with compiled artifacts published beside the weights
    why_whole: dict[str, str] = field(default_factory=dict)  # a few unpredicted tensors, and why
    diverged: dict[str, str] = field(default_factory=dict)  # what the real call did unlike its dry run (then redone)


last_load = Report()

FORMAT = "streamload"
# model_loader_extra_config keys: streamload.iter's tuning, where the weights are, and two switches.
OPTIONS: dict[str, type | tuple[type, ...]] = {
    "reader": str,
    "threads": int,
    "ring_bytes": (int, str),  # bytes, or with a unit: "1GiB"
    "slots": int,
    "chunk_bytes": (int, str),
    "cache_dir": str,
    "source": str,  # weights from here (a directory, s3://, http(s)://) while configs come from `model`
    "direct": bool,  # dry run + rank-local reads straight into the parameters (default: where it pays, `pays`)
    "cooperative": bool,  # tensor-parallel ranks divide what several of them read whole (default False)
    "verify": (bool, dict),  # check the bytes against known digests as they are read (as iter's verify=)
    "prefetch": (bool, dict),  # fetch while the engine starts (default true; the engine fills in a dict, ahead.py)
    # install the compiled artifacts published beside the weights whose digests are pinned: "sha256:<hex>"
    # or a list of them (default off: they run as code; compiled.py, pins.py)
    "compile_cache": (bool, str, list),
    "overlap": bool,  # compile and warm up while the weights arrive, then load them in place (overlap.py)
}
# For models whose first load ran as its dry run predicted (checked by the replay): which part of each
# checkpoint tensor (by name, shape and dtype) the model's loaders took, and which they never looked
# at. A reload of a checkpoint with the same tensors reads the same parts (vLLM makes a new loader for
# each reload, and after the first load the parameters no longer carry their loaders to dry-run).
_PREDICTED: weakref.WeakKeyDictionary[nn.Module, _Prediction] = weakref.WeakKeyDictionary()
_STREAM = ("reader", "threads", "ring_bytes", "slots", "chunk_bytes", "cache_dir", "verify")


def register() -> None:
    """The `vllm.general_plugins` entry point: registers the "streamload" load format and weight-transfer
    engine (idempotent)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(FORMAT) is not StreamloadModelLoader:
        register_model_loader(FORMAT)(StreamloadModelLoader)
    _check_at_config_time()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:  # weight_transfer_config={"backend": "streamload"} (sync.py)
        WeightTransferEngineFactory.register_engine(FORMAT, f"{__name__}.sync", "StreamloadWeightTransferEngine")
    except ValueError:  # registered already (the plugin runs once per process, tests call it again)
        pass
    from . import check

    check.install()  # only under `streamload vllm-check`


def check_options(extra: Any) -> dict[str, Any]:
    """`model_loader_extra_config`, checked: known keys with values of the right type."""
    if not isinstance(extra, dict):
        raise ValueError(
            f"model_loader_extra_config for load format {FORMAT!r} must be a dict, not {type(extra).__name__}"
        )
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown model_loader_extra_config keys for load format {FORMAT!r}: {', '.join(unknown)}; "
            f"known keys: {', '.join(OPTIONS)}"
        )
    checked = dict(extra)
    for key, value in extra.items():
        want = OPTIONS[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            kinds = [want] if isinstance(want, type) else list(want)
            kind = " or ".join(("an " if t.__name__[0] in "aeiou" else "a ") + t.__name__ for t in kinds)
            raise ValueError(f"model_loader_extra_config[{key!r}] must be {kind}, not {value!r}")
        try:  # sizes with units and counts of at least 1, as streamload.iter takes them
            if key in ("ring_bytes", "chunk_bytes"):
                checked[key] = arguments.size(value, key)
            elif key in ("threads", "slots"):
                arguments.count(value, key)
            elif key == "compile_cache":
                pins.pins(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model_loader_extra_config: {exc}") from None
    return checked


def _check_at_config_time() -> None:
    """Check the options where vLLM builds the engine's load config, in the process that starts the
    engine: a bad key fails at once, in one line, not seconds later in a worker's traceback."""
    from vllm.engine.arg_utils import EngineArgs

    build = EngineArgs.create_load_config
    if getattr(build, "checks_streamload", False):
        return

    def create_load_config(self: Any) -> Any:
        config = build(self)
        if str(config.load_format).lower() == FORMAT:
            extra = check_options(config.model_loader_extra_config)
            fetches = not isinstance(extra.get("prefetch"), dict) and ahead.starts_engine(self)
            if fetches and (started := ahead.begin(str(self.model), extra)):
                config.model_loader_extra_config = {**config.model_loader_extra_config, "prefetch": started}
        return config

    create_load_config.checks_streamload = True  # type: ignore[attr-defined]
    EngineArgs.create_load_config = create_load_config  # type: ignore[method-assign]


class StreamloadModelLoader(BaseModelLoader):
    """vLLM's `BaseModelLoader` on streamload's pipeline (see the module's docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = check_options(load_config.model_loader_extra_config)
        self._stats: list[Stats] = []  # the last load's streams' (not the streams: they hold the parameters)
        # vLLM's default loader in its "auto" format, asked only which files it would read.
        files_config = LoadConfig(
            load_format="hf", download_dir=load_config.download_dir, ignore_patterns=load_config.ignore_patterns
        )
        self._files = DefaultModelLoader(files_config)

    def download_model(self, model_config: ModelConfig) -> None:
        self.source(model_config, first=True)

    def source(self, model_config: ModelConfig, first: bool = False) -> str:
        """Where the weights are, resolved the way vLLM's default loader resolves a model. The `source`
        option applies to the `first` load only, not to a reload from a new path."""
        model = model_config.model
        if first and self.options.get("source"):
            return str(self.options["source"])
        if getattr(model_config, "model_weights", ""):  # object storage: vLLM pulled the configs
            return str(model_config.model_weights)
        if os.path.exists(model) or "://" in model:
            return model
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        return download_weights_from_hf(
            model,
            self.load_config.download_dir,
            ["*.safetensors", "*.safetensors.index.json"],
            model_config.revision,
            ignore_patterns=self.load_config.ignore_patterns,
        )

    def _stream_options(self, model: nn.Module) -> dict[str, Any]:
        options: dict[str, Any] = {k: self.options[k] for k in _STREAM if k in self.options}
        return {"device": _device_of(model), **options}

    def _parts(self, model_config: ModelConfig, model: nn.Module, first: bool) -> list[_Part]:
        """Every place the model's weights come from, as vLLM's `DefaultModelLoader.get_all_weights`
        finds them: the model path (the model's `allow_patterns_overrides`, `fall_back_to_pt_during_load`
        and `is_unused_checkpoint_weight` applied) and then each of its `secondary_weights`."""
        primary = DefaultModelLoader.Source(
            self.source(model_config, first),
            model_config.revision,
            fall_back_to_pt=getattr(model, "fall_back_to_pt_during_load", True),
            allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
            is_unused_weight=getattr(model, "is_unused_checkpoint_weight", None),
        )
        sources = [primary, *getattr(model, "secondary_weights", ())]
        self._where = str(primary.model_or_path)  # what a failed reload restores from (restore.py)
        return [self._part(source, primary=k == 0) for k, source in enumerate(sources)]

    def _part(self, source: Any, primary: bool) -> _Part:
        where = str(source.model_or_path)
        if "://" in where:  # object storage: the files are what streamload lists there
            if not primary or source.allow_patterns_overrides is not None:
                what = (
                    "secondary weights"
                    if not primary
                    else f"allow_patterns_overrides {source.allow_patterns_overrides}"
                )
                raise UnsupportedError(
                    f"streamload: the model's {what} cannot be honoured for weights in object storage ({where}): "
                    "give vLLM a local directory or hub id"
                )
        if "://" in where or (primary and os.path.isfile(where)):  # listed by streamload, or one file: no selection
            return _Part("", open_checkpoint(where, self.options.get("cache_dir")), [])
        # vLLM's own file selection (its "auto" format): the same files as its default loader reads.
        folder, files, _, _ = self._files._prepare_weights(
            where, source.subfolder, source.revision, source.fall_back_to_pt, source.allow_patterns_overrides
        )
        streamed = [f for f in files if f.endswith(".safetensors")]
        filtered = False
        if source.is_unused_weight is not None and streamed:
            kept = filter_safetensors_files_by_weight_name(streamed, source.is_unused_weight)
            filtered, streamed = len(kept) < len(streamed), kept
        others = [f for f in files if not f.endswith(".safetensors")]
        if primary and not streamed:
            raise UnsupportedError(
                f"streamload streams safetensors; {folder} has {', '.join(sorted({Path(f).suffix for f in others}))} "
                "weights only: use vLLM's load_format='auto' for them"
            )
        # The folder itself where vLLM takes the whole folder: its index is checked, a missing shard named.
        whole = source.allow_patterns_overrides is None and not filtered
        checkpoint = open_checkpoint(folder if whole else streamed, self.options.get("cache_dir")) if streamed else None
        # .pt/.bin (small heads, as BGE-M3's): read whole, once, with vLLM's own reader and map_location.
        pairs = pt_weights_iterator(others, False, self.load_config.pt_load_map_location) if others else ()
        return _Part(source.prefix, checkpoint, [(source.prefix + n, t) for n, t in pairs])

    def _feed(
        self,
        parts: list[_Part],
        options: dict[str, Any],
        learned: Learned | None = None,
        run: Replay | None = None,
        full_shaped: bool = False,
    ) -> Generator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every part in turn, as `load_weights` gets them. With `learned` (a dry run's
        prediction, replayed as `run`), only each rank's part of the placed tensors is read, straight into
        place, and they are handed on as their stand-ins, as are the tensors the dry run left unused.
        `full_shaped` (a reload): each rank's part is read and handed on in a tensor of the full shape."""
        quiet = run.paused if run is not None else nullcontext
        for part in parts:
            if part.checkpoint is not None:
                placed: dict[str, Any] = {}
                if learned is not None:
                    rank, world = _tp_rank_world()
                    placed["shard"] = ShardSpec(_rule(learned, part.prefix), rank, world, full_shape=full_shaped)
                    if not full_shaped:
                        placed["into"] = {
                            n[len(part.prefix) :]: learned.copies[n].dest for n in part.names if n in learned.copies
                        }
                with _opened(part.checkpoint, {**options, **placed}, quiet) as stream:
                    if full_shaped:
                        assert learned is not None
                        yield from _full_shaped(stream, part, learned)
                    else:
                        yield from _tensors(stream, part, learned, run)
                self._stats.append(stream.stats)
            yield from part.others

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        """(name, tensor) in layer order: what vLLM's `reload_weights` feeds `load_weights`. Where the
        model's first load ran as its dry run predicted and the new checkpoint has the same tensors
        (names, shapes, dtypes), the reload reads what that load read: each tensor the model's loaders
        took a part of is read in that part only and handed on full-shaped, the rest of it never
        written (nor, as the dry run showed, read); tensors they never looked at are not read.
        Otherwise whole tensors, as vLLM's default loader gives them.

        A reload that fails on any rank, at any point, leaves every rank serving the weights it had
        (restore.py): the error is raised once they are back."""
        return self._guarded(model_config, model)

    def _guarded(self, model_config: ModelConfig, model: nn.Module) -> Generator[tuple[str, torch.Tensor]]:
        world = _tp_rank_world()[1]
        failure: Exception | None = None
        touched = False
        try:  # vLLM's reload has emptied the layers: from here every rank votes, whatever happens
            for pair in self._reload(model_config, model, world, bool(self.options.get("cooperative"))):
                touched = True
                yield pair
        except Exception as exc:  # the stream's error (or the headers')
            failure = exc
        ranks = restore.Ranks.of_engine()
        decided = ranks.decide(None if failure is None else str(failure), touched)  # never raises
        if decided.ok:
            restore.SERVED[model] = self._served(model_config, self._reloaded)
            return
        previous = restore.SERVED.get(model)
        why = failure or StreamloadError(decided.lost or "another rank of the engine failed")
        wanted = getattr(self, "_where", None) or model_config.model
        self._restore(previous, decided.touched, model_config, model, f"reloading from {wanted} failed ({why})")
        served = previous.where if previous is not None else "the weights it had"
        message = f"reloading from {wanted} failed; serving {served} again: {_because(ranks, decided, why)}"
        if not ranks.last and not decided.lost:  # the last rank raises it (restore.py: why only one)
            log.error("streamload: %s", message)
            return
        raise StreamloadError(message) from why

    def _restore(
        self, previous: restore.Served | None, touched: bool, model_config: ModelConfig, model: nn.Module, failed: str
    ) -> None:
        """This rank's layers put back and, where new weights reached any (or may have), the previous
        weights read over them; `failed`: what the error says went wrong before."""
        try:
            restore.put_back_layers(model, model_config)
            if touched:  # new weights reached some layer on some rank: the previous ones are read again
                if previous is None:
                    raise StreamloadError("no earlier load of this model by streamload is known to read again")
                self._read_again(previous, model_config, model)
        except Exception as again:
            raise StreamloadError(
                f"{failed}, and so did restoring {previous.where if previous else 'the weights served before'} "
                f"({again}): this worker's weights are a mix; restart it"
            ) from again
        finally:
            if previous is not None:
                previous.put_back(model_config)

    def _read_again(self, previous: restore.Served, model_config: ModelConfig, model: nn.Module) -> None:
        """The weights `previous` names, read over the model in place (each rank alone, unchecked: they
        were checked when they were first read), from the very files read then: where any changed since
        (restore.py: `Loaded`), nothing is read and the error names each file and what changed."""
        again = StreamloadModelLoader(self.load_config)
        again.options = {k: v for k, v in self.options.items() if k not in ("cooperative", "verify")}
        config = shallow_copy(model_config)
        config.model, config.revision = previous.where, None
        if hasattr(config, "model_weights"):
            config.model_weights = ""
        parts = again._parts(config, model, first=False)  # headers only: no tensor byte read yet
        changed = previous.changes(_checkpoints(parts))
        if changed:
            raise StreamloadError(
                f"the weights served before cannot be restored: {len(changed)} of the files they were loaded "
                f"from changed since ({'; '.join(changed)})"
            )
        feed = again._reload(config, model, _tp_rank_world()[1], cooperative=False, parts=parts)
        try:
            restore.reload_over(model, model_config, feed)
        finally:
            feed.close()

    def _reload(
        self,
        model_config: ModelConfig,
        model: nn.Module,
        world: int,
        cooperative: bool,
        parts: list[_Part] | None = None,
    ) -> Generator[tuple[str, torch.Tensor]]:
        parts = parts if parts is not None else self._parts(model_config, model, first=False)
        self._reloaded, self._stats = parts, []
        options = self._stream_options(model)
        predicted = _PREDICTED.get(model)
        learned = predicted.learned(_shapes(parts)) if predicted is not None else None
        if cooperative and world > 1:
            if not every_rank(learned is not None):
                learned = None
            options["cooperative"] = _tp_group(options["device"])
        feed = self._feed(parts, options, learned, full_shaped=True) if learned else self._feed(parts, options)
        try:
            yield from feed
        finally:
            feed.close()
        _report(parts, self._stats, learned, world)

    def _served(self, model_config: ModelConfig, parts: list[_Part]) -> restore.Served:
        """What this load read (every file's identity and checked digests), for a failed reload to
        restore from (restore.py)."""
        return restore.Served.of(self._where, model_config, _checkpoints(parts), self.options.get("verify", False))

    def load_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        # A speculative drafter shares this load config; the `source` option is the main model's.
        self._main = model_config is vllm_config.model_config
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        first = getattr(self, "_main", True)
        starting = first and not getattr(self, "_loaded", False)
        started = self.options.get("prefetch") if starting else None
        self._loaded = True
        # compiled artifacts published beside the weights, installed while they load (vLLM compiles after)
        installing = self._compile_cache(model_config) if starting else None
        try:
            if starting and self.options.get("overlap"):
                # Local files' headers and vLLM's file selection now: a broken checkpoint fails before
                # minutes of compilation (remote ones are read at the end: a request now waits behind the fetch).
                local = "://" not in self.source(model_config, first=True)
                parts = self._parts(model_config, model, first=True) if local else None
                finish = partial(self._staged, started, self._in_place, model, model_config, parts)
                overlap.defer(model, model_config, finish)
            else:
                self._staged(started, self._load_weights, model, model_config, first)
        finally:
            if installing is not None:
                last_load.compile_cache = installing.result()

    def _staged(self, started: Any, load: Callable[..., None], *args: Any) -> None:
        """`load(*args)` from the files the fetch started with the engine stages (ahead.py), if any."""
        if not isinstance(started, dict):  # (another node's engine process may have started one: `ahead.loaded`)
            last_load.staged = ""
            try:
                load(*args)
            finally:
                ahead.loaded(None, *_all_ranks())
            return
        staged, options = ahead.staged(started), self.options
        last_load.staged = staged or ""
        if staged is not None:
            self.options = {**options, "cache_dir": staged}
        try:
            load(*args)
        finally:
            self.options = options
            ahead.loaded(started, *_all_ranks())

    @collector_paused
    def _in_place(self, model: nn.Module, model_config: ModelConfig, parts: list[_Part] | None) -> None:
        """The first load's weights, after compilation (overlap.py): through vLLM's in-place layerwise
        reload, whole tensors through the model's loaders, each layer processed as it completes and its
        results copied into the storage the compiled code holds."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        start = time.perf_counter()
        options, self._stats = self._stream_options(model), []
        parts = parts if parts is not None else self._parts(model_config, model, first=True)
        last_load.plan_seconds = time.perf_counter() - start
        initialize_layerwise_reload(model)
        result = _given(model, self._feed(parts, options))
        finalize_layerwise_reload(model, model_config)
        if model_config.quantization is None and result is not None:  # a weight the checkpoint lacks: vLLM's error
            DefaultModelLoader.track_weights_loading(self, model, set(result))  # type: ignore[arg-type]
        _report(parts, self._stats, None, _tp_rank_world()[1])
        last_load.seconds = time.perf_counter() - start
        log.info(
            "streamload: %.1f MB read by the %s reader into the compiled model in %.2f s",
            last_load.bytes_read / 1e6,
            last_load.reader or "no",
            last_load.seconds,
        )
        restore.SERVED[model] = self._served(model_config, parts)

    def _compile_cache(self, model_config: ModelConfig) -> concurrent.futures.Future[str] | None:
        """Compiled artifacts published beside the weights, fetched and installed on a thread of its own."""
        pinned = pins.pins(self.options.get("compile_cache"))
        if not pinned:  # off unless the user trusts an archive by its digest: it runs as code
            return None
        from . import compiled

        source = str(self.options.get("source") or model_config.model)
        if "://" not in source and not os.path.isdir(source):
            return None  # a hub id: nothing of ours is published beside it

        started = self.options.get("prefetch")

        def install() -> str:
            try:
                staged = prefetch.staged_compile_caches(started) if isinstance(started, dict) else None
                return compiled.install(source, pinned, staged=staged)
            except pins.Refused as exc:  # nothing of it unpacked: vLLM compiles as it would have
                log.error("streamload: %s", exc)
                return str(exc)
            except Exception as exc:  # an optimisation only: vLLM compiles as it would have
                log.warning("streamload: compiled artifacts published beside %s not installed: %s", source, exc)
                return f"not installed: {exc}"

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streamload-compiled")
        try:
            return pool.submit(install)
        finally:
            pool.shutdown(wait=False)

    @collector_paused  # a many-tensor model's placement is tens of thousands of objects (twins.py)
    def _load_weights(self, model: nn.Module, model_config: ModelConfig, first: bool) -> None:
        start = time.perf_counter()
        parts = self._parts(model_config, model, first=first)  # headers read once
        options, shapes, self._stats = self._stream_options(model), _shapes(parts), []
        targets = [*model.parameters(), *model.buffers()]
        infos = {name: info for part in parts for name, info in part.names.items()}
        layers, spread, forced = twins.sample(shapes), twins.Spread(), self.options.get("direct")
        learned = None
        if forced if forced is not None else pays(infos, layers.sample):
            learned = self._learn(model, parts, shapes, layers.sample, targets, options["device"])
        if learned is not None:
            try:
                spread = twins.spread(learned, layers, model)
            except Exception as exc:  # a model twins.py does not understand: its own loaders load it
                log.warning(
                    "streamload: placing %s's layers alike failed (%s); loading whole tensors",
                    type(model).__name__,
                    exc,
                )
                learned = None
            else:
                if forced is None and not pays(infos, shapes.keys() - learned.trusted):  # twins too few
                    learned = None
        last_load.plan_seconds = time.perf_counter() - start
        last_load.diverged = {}
        world = _tp_rank_world()[1]
        cooperative = bool(self.options.get("cooperative")) and world > 1
        if cooperative:
            if not every_rank(learned is not None):  # the ranks exchange only if they all read alike
                learned = None
            options["cooperative"] = _tp_group(options["device"])
        result: Any = None
        if learned is not None:
            try:  # the real call, watched: every name as in the dry run, placed tensors as their stand-ins
                with replay(learned, shapes, targets) as run:
                    result = _given(model, self._feed(parts, options, learned, run))
            except Diverged as exc:
                last_load.diverged = exc.names
            if not (every_rank(not last_load.diverged) if cooperative else not last_load.diverged):
                log.warning(
                    "streamload: %s.load_weights did not do what its dry run predicted (%s); every tensor is "
                    "read again, whole, and given to load_weights",
                    type(model).__name__,
                    Diverged(last_load.diverged) if last_load.diverged else "on another rank",
                )
                learned = None
        if learned is not None:
            _PREDICTED[model] = _Prediction(shapes, {n: c.part for n, c in learned.copies.items()}, set(learned.unused))
            result = spread.loaded(result) if result is not None else None
        if learned is None:
            result = _given(model, self._feed(parts, options))
        _report(parts, self._stats, learned, world)
        last_load.seconds = time.perf_counter() - start
        log.info(
            "streamload: %d tensors straight into their parameters (%d by a dry-run layer's twin), %d through "
            "load_weights%s, %d unused; %.1f of %.1f MB read by the %s reader",
            last_load.direct,
            last_load.by_twin,
            last_load.through_model,
            f" (e.g. {last_load.why_whole})" if last_load.why_whole else "",
            last_load.unused,
            last_load.bytes_read / 1e6,
            last_load.bytes_total / 1e6,
            last_load.reader or "no",
        )
        log.info("Loading weights took %.2f seconds", last_load.seconds)
        restore.SERVED[model] = self._served(model_config, parts)
        if model_config.quantization is None and result is not None:  # None: the model does not track
            DefaultModelLoader.track_weights_loading(self, model, set(result))  # type: ignore[arg-type]

    def _learn(
        self,
        model: nn.Module,
        parts: list[_Part],
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
        sample: list[str],
        targets: list[torch.Tensor],
        device: torch.device,
    ) -> Learned | None:
        """A dry run of `load_weights` given the tensors `sample` (of `shapes`: every tensor)."""
        if _quantized_while_loading(model):  # its loaders record what they get for later: no stand-ins
            return None
        try:
            learned, _ = dry_run(model.load_weights, {name: shapes[name] for name in sample}, targets)
        except Exception as exc:  # the real run gives the model's own error, if it is one
            log.warning(
                "streamload: the dry run of %s.load_weights failed (%s); loading whole tensors",
                type(model).__name__,
                exc,
            )
            return None
        for part in parts:
            learned.whole.update(dict.fromkeys(part.names.keys() - shapes.keys(), "no torch dtype"))
            for name, _ in part.others:
                learned.copies.pop(name, None)
                learned.unused.discard(name)
                learned.whole[name] = "a .pt/.bin file, read whole as vLLM reads it"
        for name, copy in list(learned.copies.items()):  # what the stream cannot write in place, the model does
            why = _cannot_write(copy.dest, shapes[name][1], device)
            if why:
                del learned.copies[name]
                learned.whole[name] = why
        return learned


# The dry run and the watched real call cost ~0.57 ms a tensor here (vLLM's CPU build, Qwen3-MoE's
# per-expert loaders); what they save is a copy of each tensor's bytes, the weight loaders' work and,
# under tensor parallelism, the other ranks' parts. Twin layers are neither dry-run nor watched, so
# what counts is the tensors outside them; where those are many and small, every tensor loads whole
# through `load_weights`, as vLLM's own loader loads it.
MANY_TENSORS = 4096
SMALL_MEAN_BYTES = 4 << 20


def pays(infos: Mapping[str, TensorInfo], watched: Collection[str]) -> bool:
    """Whether a dry run (or a watched real call) given the tensors `watched` of the checkpoint's
    `infos` is worth its per-tensor cost: few of them, or large ones on average."""
    if len(watched) <= MANY_TENSORS:
        return True
    return sum(infos[n].nbytes for n in watched if n in infos) / len(watched) >= SMALL_MEAN_BYTES


@dataclass
class _Prediction:
    """What a first load's checked dry run learnt, kept for the model's reloads (see `_PREDICTED`)."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    parts: dict[str, Slice | None]  # taken by the model's loaders: this rank's part (None: all of it)
    unused: set[str]

    def learned(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Learned | None:
        """The prediction for a checkpoint of these tensors, or None where they differ from the first's."""
        if shapes != self.shapes:
            return None
        copies = {n: Copy(None, part) for n, part in self.parts.items()}  # type: ignore[arg-type]  # no dest
        return Learned(copies, set(self.unused))


class _Part:
    """One place the model's weights come from (the model path, or one of its `secondary_weights`): its
    safetensors files, streamed, and the tensors of its .pt/.bin files, read as vLLM reads them; every
    name prefixed by `prefix`."""

    def __init__(self, prefix: str, checkpoint: Checkpoint | None, others: list[tuple[str, torch.Tensor]]) -> None:
        self.prefix, self.checkpoint, self.others = prefix, checkpoint, others
        order = ordered(checkpoint, checkpoint.tensors) if checkpoint is not None else []
        self.names = {prefix + t.name: t for t in order}  # in the order the stream hands them out


def _shapes(parts: list[_Part]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of every tensor `load_weights` gets, in the order it gets them."""
    shapes = {}
    for part in parts:
        for name, info in part.names.items():
            shape, dtype = torch_shape(info.dtype, info.shape), info.dtype.torch_dtype
            if shape is not None and dtype is not None:
                shapes[name] = (shape, dtype)
        shapes.update((name, (tuple(t.shape), t.dtype)) for name, t in part.others)
    return shapes


@contextmanager
def _opened(checkpoint: Checkpoint, options: dict[str, Any], quiet: Callable[[], Any]) -> Iterator[Any]:
    """`api.iter(checkpoint, **options)`, planned and closed within `quiet()` (during a replay: the
    stream's work is not the loader's, and not watched)."""
    with quiet():
        stream = api.iter(checkpoint, **options)
    try:
        yield stream
    finally:
        with quiet():
            stream.close()


def _given(model: nn.Module, feed: Generator[tuple[str, torch.Tensor]]) -> Any:
    """`model.load_weights(feed)`; then whatever it left unread is read, so that cooperative ranks stay
    in step (also when the call diverged from its dry run) and placed tensors land; the feed (its
    stream) is closed on every way out."""
    with closing(feed):
        try:
            result = model.load_weights(feed)
        except Diverged:
            for _ in feed:
                pass
            raise
        for _ in feed:
            pass
        return result


def _checkpoints(parts: list[_Part]) -> list[Checkpoint]:
    return [part.checkpoint for part in parts if part.checkpoint is not None]


def _because(ranks: restore.Ranks, decided: restore.Decision, why: Exception) -> str:
    """A failed reload's reasons: this rank's alone, or every rank's that had one (and why the ranks
    could not decide together, if they could not)."""
    if ranks.world == 1:
        return str(why)
    said = [f"rank {r}: {t}" for r, t in enumerate(decided.reasons) if t]
    return "; ".join([*said, decided.lost] if decided.lost else said)


def _cannot_write(dest: torch.Tensor, stored: torch.dtype, device: torch.device) -> str:
    """Why `iter(into=...)` would refuse `dest` (the checks its plan and `api.iter` make), or ""."""
    if not devices.same(dest.device, device):
        return f"its parameter is on {dest.device}"
    if not converts(stored, dest.dtype):
        return f"{stored} into a {dest.dtype} parameter"
    if dest.requires_grad:
        return "its parameter requires grad"
    return ""


def _quantized_while_loading(model: nn.Module) -> bool:
    return any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules()) or any(
        p.is_meta for p in model.parameters()
    )


def _union(loaded: set[str] | None, result: Any) -> set[str] | None:
    return None if loaded is None or result is None else loaded | set(result)


def every_rank(ok: bool) -> bool:
    """Whether `ok` holds on every tensor-parallel rank (a collective over vLLM's TP group)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return bool(flag.item())


def _report(parts: list[_Part], stats: list[Stats], learned: Learned | None, world: int) -> None:
    """`last_load`, from the streams' stats of this load (a load that diverged and was redone: both)."""
    last_load.bytes_read = sum(s.bytes_read for s in stats)
    last_load.reader = ", ".join(dict.fromkeys(s.reader for s in stats))
    last_load.bytes_total = sum(part.checkpoint.nbytes for part in parts if part.checkpoint is not None)
    every = [name for part in parts for name in (*part.names, *(n for n, _ in part.others))]
    last_load.direct = len(learned.copies) if learned else 0
    last_load.unused = len(learned.unused) if learned else 0
    last_load.by_twin = len(learned.trusted - learned.unused) if learned else 0
    last_load.through_model = len(every) - last_load.direct - last_load.unused
    split = {n for n, c in learned.copies.items() if c.part is not None} if learned else set()
    unused = learned.unused if learned else set()
    last_load.bytes_fair = sum(
        t.nbytes // world if n in split else t.nbytes for p in parts for n, t in p.names.items() if n not in unused
    )
    last_load.why_whole = dict(list(learned.whole.items())[:3]) if learned else {}


def _rule(learned: Learned, prefix: str) -> Any:
    """A `ShardSpec` rule for one part's stream: each placed tensor's predicted part, SKIP for unused."""

    def rule(name: str, shape: tuple[int, ...]) -> Slice | str | None:
        copy = learned.copies.get(prefix + name)
        if copy is not None:
            return copy.part
        return SKIP if prefix + name in learned.unused else None

    return rule


def _tensors(
    stream: Any, part: _Part, learned: Learned | None, run: Replay | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A part's stream as `load_weights` gets it: every name, prefixed; with a replay, placed and unused
    tensors as their stand-ins (the unused ones, never read, where the dry run had them)."""
    if learned is None or run is None:
        yield from ((part.prefix + name, t) for name, t in stream)
        return
    trusted = learned.trusted
    for name, t in _in_order(part, _paused(stream, run, part.prefix, trusted), learned.unused - trusted):
        yield name, run.stand_in(name) if t is None or name in learned.copies else t


def _paused(stream: Any, run: Replay, prefix: str, trusted: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's tensors but the `trusted` ones (in place already, and not for the real call), taken
    with the replay's watch paused: the stream's own writes into place are not the loader's."""
    arrived = iter(stream)
    while True:
        with run.paused():
            item = next((item for item in arrived if prefix + item[0] not in trusted), None)
        if item is None:
            return
        yield item


def _full_shaped(stream: Any, part: _Part, learned: Learned) -> Iterator[tuple[str, torch.Tensor]]:
    """A reload's stream as `load_weights` gets it: every name, prefixed; a tensor read in part is
    full-shaped already (`ShardSpec(full_shape=True)`), one never looked at is handed on as an
    uninitialised tensor (host memory commits only the pages written)."""
    unused: list[str] = []  # made on the next tensor's device (after the last one: the host)
    for name, t in _in_order(part, stream, learned.unused):
        if t is None:
            unused.append(name)
            continue
        yield from ((n, _empty(part.names[n], t.device)) for n in unused)
        unused.clear()
        yield name, t
    yield from ((n, _empty(part.names[n], None)) for n in unused)


def _in_order(
    part: _Part, arrived: Iterable[tuple[str, torch.Tensor]], unused: Collection[str]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The names `load_weights` gets from a part, in the stream's order: each tensor that arrived
    (prefixed), and each name the dry run left unused (never read: None) at its place among them."""
    pending = iter(part.names)
    for name, t in arrived:
        name = part.prefix + name
        for before in pending:
            if before == name:
                break
            if before in unused:
                yield before, None
        yield name, t
    yield from ((n, None) for n in pending if n in unused)


def _empty(info: Any, device: torch.device | None) -> torch.Tensor:
    return torch.empty(torch_shape(info.dtype, info.shape), dtype=info.dtype.torch_dtype, device=device)


def _device_of(model: nn.Module) -> torch.device:
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:  # an in-place reload puts layers on meta until their weights are in
        from vllm.platforms import current_platform

        device = torch.device(current_platform.device_type)
    return devices.resolve(device)


def _tp_rank_world() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no model-parallel groups: a model built outside an engine
        return 0, 1


def _all_ranks() -> tuple[int, Callable[[], None]]:
    """This worker's rank among all of the engine's (every stage of every parallelism), and a barrier
    of them all (a model built outside an engine: 0 and nothing to wait for)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, lambda: None
    from vllm.distributed import get_world_group

    group = get_world_group()
    return group.rank, lambda: dist.barrier(group=group.cpu_group)


def _tp_group(device: torch.device) -> Any:
    """vLLM's group of the tensor-parallel ranks (every rank is in load_weights when it is used)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.device_group if device.type == "cuda" else group.cpu_group


__all__ = [
    "FORMAT",
    "OPTIONS",
    "Report",
    "StreamloadError",
    "StreamloadModelLoader",
    "check_options",
    "last_load",
    "register",
]
