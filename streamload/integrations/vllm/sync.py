"""The "streamload" weight-transfer engine: vLLM's weight-sync life-cycle, from a checkpoint.

An RL loop (or anyone hot-swapping weights) publishes each step as a checkpoint — a directory, or an
`s3://` / `http(s)://` prefix; `streamload.publish.publish` writes one atomically — and tells every
engine where it is. Each worker then reloads in place through vLLM's own layerwise reload, reading
only its rank's part of each tensor (`StreamloadModelLoader.get_all_weights`), with the options of
the streamload load format (threads, cooperative, ...):

    llm = LLM(model, load_format="streamload", weight_transfer_config={"backend": "streamload"})
    llm.init_weight_transfer_engine({"init_info": {"options": {"threads": 16}}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": "/ckpt/run/step-7", "verify": True}})
    llm.finish_weight_update("step-7")

Never half-applied: an update whose checkpoint is corrupt or goes missing mid-read (`verify` checks
the digest file that `publish` writes; a vanished shard is a read error) fails naming the file and
tensor, and the worker first reloads the step it served before (or the model it started with), so
it serves those weights afterwards, not a mix. The engine is registered by the plugin.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config.load import LoadConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from streamload.errors import StreamloadError

log = logging.getLogger("streamload")
BACKEND = "streamload"


@dataclass
class StreamloadInitInfo(WeightTransferInitInfo):
    """`options`: as the streamload load format's `model_loader_extra_config` (threads, cooperative, ...)."""

    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamloadUpdateInfo(WeightTransferUpdateInfo):
    """`path`: the step's checkpoint (a directory, s3://, http(s)://); `verify`: check its digests (True:
    the digest file next to it, or {file name: SHA-256})."""

    path: str
    verify: bool | dict[str, str] = False


class StreamloadWeightTransferEngine(WeightTransferEngine[StreamloadInitInfo, StreamloadUpdateInfo]):
    """Each update reloads the model in place from a checkpoint (see the module's docstring)."""

    init_info_cls = StreamloadInitInfo
    update_info_cls = StreamloadUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options: dict[str, Any] = {}
        self.served: str | None = None  # the step the model holds now (None: what it was started with)

    def init_transfer_engine(self, init_info: StreamloadInitInfo) -> None:
        from . import check_options

        self.options = check_options(init_info.options)

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: StreamloadUpdateInfo) -> None:
        from . import every_rank

        failure: Exception | None = None
        try:
            self._reload(update_info.path, update_info.verify)
        except Exception as exc:
            failure = exc
        # Every tensor-parallel rank restores, or none: a rank that failed alone must not leave the
        # others on the new step (the model would be a mix across ranks).
        if every_rank(failure is None):
            self.served = update_info.path
            return
        previous = self.served or self._first_weights()
        why = failure or StreamloadError("another tensor-parallel rank failed")
        log.error("streamload: the update to %s failed (%s); serving %s again", update_info.path, why, previous)
        try:
            # vLLM's layerwise reload stopped mid-way: layers it had not filled are on meta or hold
            # buffered parts. Its own finalisation puts every layer back in place (the old tensors
            # where nothing arrived); then the previous step is read over all of it.
            finalize_layerwise_reload(self.model, self.model_config)
            self._reload(previous, False)
        except Exception as again:
            raise StreamloadError(
                f"the update to {update_info.path} failed ({why}), and so did restoring {previous} ({again}): "
                "this worker's weights are a mix; restart it"
            ) from again
        raise StreamloadError(f"the update to {update_info.path} failed; serving {previous} again: {why}") from why

    def _first_weights(self) -> str:
        """Where the weights the engine started with came from, resolved as the load format resolves
        them (a `source` option, object storage whose configs vLLM pulled, a hub id)."""
        from . import StreamloadModelLoader

        return StreamloadModelLoader(self.vllm_config.load_config).source(self._default_model_config, first=True)

    def _reload(self, path: str, verify: bool | dict[str, str]) -> None:
        from . import FORMAT, StreamloadModelLoader

        options = {**self.options, **({"verify": verify} if verify else {})}
        loader = StreamloadModelLoader(LoadConfig(load_format=FORMAT, model_loader_extra_config=options))
        model_config = copy.copy(self.model_config)  # a step's path, not the model's: configs stay
        model_config.model, model_config.model_weights, model_config.revision = path, "", None
        weights = loader.get_all_weights(model_config, self.model)  # before the reload empties the layers
        try:
            reload_weights(self.vllm_config, self.model, weights, None, is_checkpoint_format=True)
        finally:
            weights.close()  # a failed stream lets go of its threads and slots before anything else reads

    def shutdown(self) -> None:
        pass
