"""vLLM's ``multi_modal_data`` for a request's media: from the decoded items (the stages that get raw media), and
from stand-ins (the consumers of an encode stage's embeddings, whose engines get the items' shapes only).

A stand-in (:class:`~trident.protocol.StandIn`) keeps an item's shape and drops its values. vLLM's processors
size an item's placeholder range, and Qwen's 3-D positions, from the shape alone, whatever the model: so a
consumer gives vLLM zeros of the same shape under the item's id, and the real encoder output reaches the engine
from the encode stage (:mod:`trident.engines.vllm_ec_connector`) or is not needed (a decode, whose KV covers the
prompt). No model family's code is involved on that side.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import tracing
from ..media.image import image_digest
from ..processor import Processor
from ..protocol import StandIn
from .base import MediaEmbeddings


def decode_media(processor: Processor, media: list) -> tuple[dict, MediaEmbeddings, list[str]]:
    """Decode the raw items: vLLM's ``multi_modal_data`` (raw items by kind), the items' layout (token
    counts, grids, kinds and seconds per temporal patch; no embeddings) and their content ids, in order."""
    family = processor.family
    with tracing.step("media_decode"):
        decoded = processor.open(media)
    mm: dict = {}
    counts: list[int] = []
    grids: list = []
    seconds: list[float] = []
    for kind in dict.fromkeys(item.kind for item in media):
        items = [d for d, item in zip(decoded, media) if item.kind == kind]
        mm[kind] = family.vllm_inputs(processor, kind, items)
        c, g = family.layout(processor, kind, items)
        counts += c
        grids += g if g is not None else [None] * len(c)
        seconds += family.clip_seconds(processor, kind, items) or [0.0] * len(c)
    layout = MediaEmbeddings(
        torch.empty(0), counts, grids if any(g is not None for g in grids) else None,
        [item.kind for item in media], seconds if any(seconds) else None,
    )
    ids = [image_digest(d) if item.kind == "image" else item.content_id for d, item in zip(decoded, media)]
    return mm, layout, ids


def stand_ins_of(mm: dict, kinds: list[str]) -> list[StandIn]:
    """The stand-ins of ``decode_media``'s ``multi_modal_data``, in the items' order (``kinds``: each item's)."""
    taken = dict.fromkeys(mm, 0)
    out = []
    for kind in kinds:
        out.append(_stand_in(mm[kind][taken[kind]]))
        taken[kind] += 1
    return out


def _stand_in(value) -> StandIn:
    from PIL import Image

    if isinstance(value, Image.Image):
        return StandIn([value.height, value.width], image=True)
    if isinstance(value, tuple) and len(value) == 2:
        array, extra = value
        base = _stand_in(array)
        if isinstance(extra, dict):
            return StandIn(base.shape, dtype=base.dtype, meta=dict(extra))
        return StandIn(base.shape, dtype=base.dtype, rate=int(extra))
    array = np.asarray(value)
    return StandIn(list(array.shape), dtype=str(array.dtype))


def stand_in_value(stand_in: StandIn):
    """vLLM's item for a stand-in: a black image, or zeros of the array's shape (with its rate or metadata)."""
    if stand_in.image:
        from PIL import Image

        height, width = stand_in.shape
        return Image.new("RGB", (width, height))
    zeros = np.zeros(stand_in.shape, dtype=stand_in.dtype)
    if stand_in.meta is not None:
        return zeros, dict(stand_in.meta)
    if stand_in.rate is not None:
        return zeros, stand_in.rate
    return zeros


def mm_of(stand_ins: list[StandIn], kinds: list[str]) -> dict:
    """``multi_modal_data`` of stand-ins, by kind in the items' order."""
    mm: dict = {}
    for kind, stand_in in zip(kinds, stand_ins):
        mm.setdefault(kind, []).append(stand_in_value(stand_in))
    return mm


def outputs_param(ids: list[str], emb: MediaEmbeddings) -> dict:
    """``ec_transfer_params`` carrying each item's embedding rows to the engine's EC connector, by item id."""
    from .vllm_ec_connector import PARAMS_KEY, rows_param

    items = {item_id: rows_param(item_id, rows) for item_id, rows in zip(ids, emb.embeddings.split(emb.token_counts))}
    return {PARAMS_KEY: list(items.values())}
