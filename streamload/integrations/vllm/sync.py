"""The "streamload" weight-transfer engine: vLLM's weight-sync life-cycle, from a checkpoint.

An RL loop (or anyone hot-swapping weights) publishes each step as a checkpoint — a directory, or an
`s3://` / `http(s)://` prefix; `streamload.commands.publish.publish` writes one atomically — and tells every
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
tensor, once every rank serves the step it served before (or the model it started with) again, not
a mix: the loader's reload restores them (reload.py), as for `reload_weights`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from vllm.config.load import LoadConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from streamload.device import KINDS


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
    init_info_cls = StreamloadInitInfo
    update_info_cls = StreamloadUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: StreamloadInitInfo) -> None:
        from streamload.integrations.vllm.options import check_options

        self.options = check_options(init_info.options)

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if (kind := KINDS.get(self.device.type)) is not None:  # a type streamload does not serve: nothing to wait for
            kind.synchronize(self.device)

    def receive_weights(self, update_info: StreamloadUpdateInfo) -> None:
        """The step's weights, in place; a failed update raises once every rank serves its previous
        weights again (the loader's reload restores them: reload.py)."""
        from streamload.integrations.vllm.loader import StreamloadModelLoader
        from streamload.integrations.vllm.options import FORMAT

        options = {**self.options, **({"verify": update_info.verify} if update_info.verify else {})}
        loader = StreamloadModelLoader(LoadConfig(load_format=FORMAT, model_loader_extra_config=options))
        model_config = copy.copy(self.model_config)  # a step's path, not the model's: configs stay
        model_config.model, model_config.model_weights, model_config.revision = update_info.path, "", None
        weights = loader.get_all_weights(model_config, self.model)
        try:
            reload_weights(self.vllm_config, self.model, weights, None, is_checkpoint_format=True)
        finally:
            weights.close()  # a failed stream lets go of its threads and slots before anything else reads

    def shutdown(self) -> None:
        pass
