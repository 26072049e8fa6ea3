"""vLLM's ``multi_modal_data`` for a request's media: from the decoded items (the stages that get raw media), and
from stand-ins (the consumers of an encode stage's embeddings, whose engines get the items' shapes only).

A stand-in (:class:`~trident.core.protocol.StandIn`) keeps an item's shape and drops its values. vLLM's processors
size an item's placeholder range, and Qwen's 3-D positions, from the shape alone, whatever the model: so a
consumer gives vLLM zeros of the same shape under the item's id, and the real encoder output reaches the engine
from the encode stage (:mod:`trident.worker.engines.vllm_ec_connector`) or is not needed (a decode, whose KV covers the
prompt). No model family's code is involved on that side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trident.core import tracing
from trident.core.errors import InvalidRequest
from trident.core.media.image import image_digest
from trident.core.processor import Processor
from trident.core.protocol import StandIn
from trident.worker.engines.base import MediaEmbeddings


def decode_media(processor: Processor, media: list) -> tuple[dict, list[str], list[str]]:
    """Decode the raw items: vLLM's ``multi_modal_data`` (raw items by kind), each item's kind and its content id,
    in order."""
    family = processor.family
    with tracing.step("media_decode"):
        decoded = processor.open(media)
    mm: dict = {}
    for kind in dict.fromkeys(item.kind for item in media):
        mm[kind] = family.vllm_inputs(processor, kind, [d for d, item in zip(decoded, media) if item.kind == kind])
    ids = [image_digest(d) if item.kind == "image" else item.content_id for d, item in zip(decoded, media)]
    return mm, [item.kind for item in media], ids


@dataclass
class Rendered:
    """A prompt as vLLM processed it (:func:`render`)."""

    engine_input: dict  # what ``AsyncLLM.generate`` takes without processing it again
    text_ids: list[int]  # the text's token ids, one placeholder per item (what records digest)
    token_counts: list[int]  # each item's embedding count, in the items' order
    ends_in: str | None  # the kind of the item whose embeddings end the prompt, if one does

    @property
    def length(self) -> int:
        """The prompt's token count with its media expanded."""
        return len(self.engine_input["prompt_token_ids"])


async def render(llm, processor: Processor, text: str, mm: dict | None, kinds: list[str], item_ids: list[str]) -> Rendered:
    """The prompt through vLLM's own input processing (its renderer: tokens, media processor, placeholder
    expansion), checked against the context window. Each item's embedding count is the placeholder range vLLM
    gives it, so no model family's layout is needed; the engine is then given the result as it is."""
    ids = processor.tokenizer(text)["input_ids"]
    prompt: dict = {"prompt_token_ids": ids}
    if mm:
        prompt["multi_modal_data"] = mm
        prompt["multi_modal_uuids"] = {kind: [i for i, k in zip(item_ids, kinds) if k == kind] for kind in dict.fromkeys(kinds)}
    from vllm.exceptions import VLLMClientError

    try:
        with tracing.step("vllm_render"):
            # skip_mm_cache: vLLM's processing cache only, not the cache of items its engine core holds. An item that
            # cache takes is sent to the core with the request; a request refused after rendering (by vLLM's
            # processor or by Trident's checks) never reaches the core, and the next request with that item would be
            # sent its hash alone: seen here, every later request with that image failed
            (engine_input,) = await llm.renderer.render_cmpl_async([prompt], skip_mm_cache=True)
    except VLLMClientError as e:  # (a request vLLM refuses: the prompt too long for the context window, ...)
        if getattr(e, "parameter", None) == "input_tokens" and isinstance(getattr(e, "value", None), int):
            processor.check_length(e.value)  # (the window's own message)
        raise InvalidRequest(str(e)[:500]) from None
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # vLLM's media processors refuse input with these
        raise InvalidRequest(f"vLLM's processor for this model could not place the prompt's media: {str(e)[:300]}") from None
    length = len(engine_input["prompt_token_ids"])
    processor.check_length(length)
    ranges = engine_input.get("mm_placeholders") or {}
    taken = dict.fromkeys(ranges, 0)
    counts, ends_in = [], None
    for kind in kinds:
        if taken.get(kind, 0) >= len(ranges.get(kind, ())):
            raise InvalidRequest(f"vLLM placed fewer {kind} items in the prompt than the request carries")
        r = ranges[kind][taken[kind]]
        taken[kind] += 1
        embeds = r.is_embed
        counts.append(int(embeds.sum()) if embeds is not None else r.length)
        if r.offset + r.length == length and (embeds is None or bool(embeds[-1])):
            ends_in = kind
    return Rendered(engine_input, ids, counts, ends_in)


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
    from trident.worker.engines.vllm_ec_connector import PARAMS_KEY, rows_param

    items = {item_id: rows_param(item_id, rows) for item_id, rows in zip(ids, emb.embeddings.split(emb.token_counts))}
    return {PARAMS_KEY: list(items.values())}
