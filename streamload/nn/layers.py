"""`streamload.layers`: whole layers, each handed out once every one of its tensors has arrived."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import torch

from streamload.api import iter as stream_tensors
from streamload.base.stats import Stats
from streamload.pipeline.stream import TensorStream
from streamload.plan.checkpoint import Source
from streamload.plan.layer_keys import group_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from streamload.options import Options

Group = tuple[str, dict[str, torch.Tensor]]


class LayerStream:
    """`(key, {name: tensor})` per group, as each group completes; use like a `TensorStream`
    (`for`/`async for`, ideally inside `with`/`async with`). `stats` are the tensor stream's."""

    def __init__(self, stream: TensorStream, key: Callable[[str], str]) -> None:
        self.stream = stream
        self._key = key
        self._left = Counter(key(i.name) for i in stream.plan.items)
        self._partial: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def stats(self) -> Stats:
        return self.stream.stats

    @property
    def group_keys(self) -> list[str]:
        """Every group key, in the order the plan reads them."""
        return list(self._left)

    def _add(self, name: str, t: torch.Tensor) -> Group | None:
        key = self._key(name)
        self._partial.setdefault(key, {})[name] = t
        self._left[key] -= 1
        return None if self._left[key] else (key, self._partial.pop(key))

    def __iter__(self) -> Iterator[Group]:
        for name, t in self.stream:
            if (done := self._add(name, t)) is not None:
                yield done

    async def __aiter__(self) -> AsyncIterator[Group]:
        async for name, t in self.stream:
            if (done := self._add(name, t)) is not None:
                yield done

    def __enter__(self) -> LayerStream:
        self.stream.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the tensor stream and drop the tensors of groups not yet complete."""
        self._partial.clear()
        self.stream.close()

    async def __aenter__(self) -> LayerStream:
        await self.stream.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._partial.clear()
        await self.stream.aclose()


def layers(source: Source, *, key: Callable[[str], str] | None = None, **options: Unpack[Options]) -> LayerStream:
    """Stream a checkpoint layer by layer, each layer handed out once all its tensors are in.

    Args:
        source: as for `iter`.
        key: maps a tensor name to its group (default: the tensors before the layers as `"pre"`,
            each layer `"model.layers.0"`, ..., the rest as `"post"`).
        **options: the options of `iter` (`Options`).

    Returns:
        A `LayerStream` of (key, {name: tensor}); groups spanning shard files arrive in layer order.

    Raises:
        StreamloadError: as `iter` raises them.

    Example:
        >>> for key, tensors in streamload.layers("model/", device="cpu"):  # doctest: +SKIP
        ...     print(key, len(tensors))
        pre 1
        model.layers.0 9
    """
    return LayerStream(stream_tensors(source, **options), key or group_of)
