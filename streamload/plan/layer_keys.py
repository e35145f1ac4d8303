"""Which layer a tensor belongs to, from its name."""

from __future__ import annotations

import re
from typing import NamedTuple

# `model.layers.3.`, `transformer.h.3.`, `blocks.3.`, `encoder.layer.3.`, `decoder.block.3.`, and
# diffusers' `unet.down_blocks.3.`, `transformer.single_transformer_blocks.3.` ...
_LAYER = re.compile(r"^(?P<prefix>(?:.*?\.)?(?:layers|layer|h|(?:\w+_)?blocks|block))\.(?P<index>\d+)(?:\.|$)")
# Tensors of no layer that belong before the layers; everything else of no layer (final norm, head) goes after.
_FRONT = re.compile(r"embed|(^|\.)(wte|wpe|shared|cls_token|pos_embed|patch_embed|tok_embeddings)(\.|$)")


class Layer(NamedTuple):
    name: str  # e.g. "model.layers.3"
    index: int


def layer_of(name: str) -> Layer | None:
    """The layer a tensor name belongs to, or None.

    >>> layer_of("model.layers.3.mlp.up_proj.weight")
    Layer(name='model.layers.3', index=3)
    >>> layer_of("unet.down_blocks.1.attentions.0.proj_in.weight")
    Layer(name='unet.down_blocks.1', index=1)
    >>> layer_of("lm_head.weight") is None
    True
    """
    try:
        m = _LAYER.match(name)
    except TypeError:  # (a try costs nothing where the name is text: this runs for every tensor)
        raise TypeError(f"layer_of: name must be a tensor name (text), not {type(name).__name__} {name!r}") from None
    if m is None:
        return None
    return Layer(f"{m['prefix']}.{m['index']}", int(m["index"]))


def layer_rank(name: str) -> tuple[int, int]:
    """Sort key of layer order: (0, 0) before the layers, (1, i) in layer i, (2, 0) after them."""
    layer = layer_of(name)
    if layer is not None:
        return (1, layer.index)
    return (0, 0) if _FRONT.search(name) else (2, 0)


def group_of(name: str) -> str:
    """The group `streamload.layers` puts a tensor in: its layer, else "pre" or "post".

    >>> group_of("model.embed_tokens.weight"), group_of("model.layers.2.mlp.experts.7.w1"), group_of("lm_head.weight")
    ('pre', 'model.layers.2', 'post')
    """
    layer = layer_of(name)
    if layer is not None:
        return layer.name
    return "pre" if _FRONT.search(name) else "post"
