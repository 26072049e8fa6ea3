"""Model families: what differs between LLaVA, Qwen2-VL, Qwen2-Audio and whatever comes next, one adapter
file each.

An adapter (a :class:`Family`) holds, per modality it takes (image, video, audio), the prompt placeholder
and its token, the preprocessing, the encoder call, plus the
multimodal inputs of a transformers prefill and the form of an item a vLLM engine takes. Adding a family is one new module here
that defines ``FAMILY`` (plus its demo builder in :mod:`trident.dev.demo`); nothing else chooses by family.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Placeholder:
    """How a prompt marks one item of a modality: ``text`` once per item (the chat template's), holding
    ``token``, which the prompt expands to the item's embedding count (empty where only the engine knows how its
    placeholder expands: an :class:`Unlisted` family's on the vllm engine)."""

    text: str
    token: str
    expands_to: str | None = None  # what the processor writes in place of ``text``, holding ``token`` once (None: text)
    timed: bool = False  # the processor writes each temporal patch's time in the prompt (Qwen3-VL's clips)


_TOKEN_TYPES = {"image": 1, "video": 2, "audio": 3}  # transformers' mm_token_type_ids (text: 0)


class Family:
    """The adapter interface, whose defaults are transformers' own multimodal API (``get_{kind}_features``,
    ``mm_encoder_outputs``, grids and token types): :mod:`.llava` is declared facts alone (placeholder, classes);
    :mod:`.qwen2vl` adds video preprocessing without torchvision, :mod:`.qwen2audio` an audio encoder call transformers
    has no such function for."""

    listed = True  # an adapter of this package: the hf engine serves it
    name: str  # short id ("llava")
    model_type: str  # transformers config ``model_type`` it serves
    model_class: str  # transformers class name of the checkpoint
    placeholders: dict[str, Placeholder]  # by modality: the modalities the family takes
    rows_joined = False  # its forward takes each kind's rows as one tensor (else one per item)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.placeholders)

    @property
    def placeholder(self) -> str:
        """The image placeholder (image families)."""
        return self.placeholders["image"].text

    @property
    def image_token(self) -> str:
        return self.placeholders["image"].token

    def load_model(self, path, dtype):
        import transformers

        return getattr(transformers, self.model_class).from_pretrained(path, dtype=dtype, attn_implementation="sdpa")

    # -- media -> model inputs -> embeddings ------------------------------------------------------------
    def media_inputs(self, processor, kind: str, items: list) -> dict:
        """Model inputs of decoded items of one kind (PIL images by default)."""
        out = processor.image_processor(images=items, return_tensors="pt")
        return {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}

    def encode(self, model, kind: str, inputs: dict) -> tuple[list, list[list[int]] | None]:
        """Run the encoder + projector over one kind's inputs: per-item embeddings and grids (if any). By default
        transformers' own ``get_{kind}_features`` of the model, given the inputs it names (its other arguments from
        the model's config), its ``pooler_output`` per item; grids are the inputs' ``{kind}_grid_thw``."""
        import inspect

        features = getattr(model, f"get_{kind}_features")
        named = inspect.signature(features).parameters
        out = features(**{k: v for k, v in inputs.items() if k in named}, return_dict=True)
        grids = inputs.get(f"{kind}_grid_thw")
        return list(out.pooler_output), (grids.tolist() if grids is not None else None)

    # -- prefill ---------------------------------------------------------------------------------------
    def prefill_inputs(self, model, input_ids, media, token_ids: dict[str, int]) -> dict[str, Any]:
        """Inputs of a transformers forward pass over a prompt with ``media`` (a
        :class:`~trident.worker.engines.base.MediaEmbeddings`), beyond ``input_ids`` and ``attention_mask``:
        by default the embeddings as ``mm_encoder_outputs`` (the encoders are not run again), and where the model's
        forward takes them, each kind's grids (``{kind}_grid_thw``) and the tokens' kinds (``mm_token_type_ids``:
        text 0, image 1, video 2, audio 3), from which it places them."""
        import inspect

        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        takes = inspect.signature(model.forward).parameters
        by_kind = media.by_kind()
        kwargs: dict[str, Any] = {"mm_encoder_outputs": {
            kind: BaseModelOutputWithPooling(pooler_output=torch.cat(rows) if self.rows_joined else rows)
            for kind, (rows, _) in by_kind.items()}}
        for kind, (_, grids) in by_kind.items():
            if grids and f"{kind}_grid_thw" in takes:
                kwargs[f"{kind}_grid_thw"] = torch.tensor(grids, dtype=torch.long, device=input_ids.device)
        if "mm_token_type_ids" in takes:
            types = torch.zeros_like(input_ids, dtype=torch.int)
            for kind in by_kind:
                types[input_ids == token_ids[kind]] = _TOKEN_TYPES[kind]
            kwargs["mm_token_type_ids"] = types
        return kwargs

    def item_text(self, kind: str, rows: int, grid: list[int] | None, seconds: float, frames: int) -> tuple[str, list[int]]:
        """What the prompt holds in place of one item's placeholder, and the lengths of the runs of the kind's token
        in it (which together hold the item's ``rows``): by default the placeholder as the processor writes it, one run."""
        placeholder = self.placeholders[kind]
        return (placeholder.text if placeholder.expands_to is None else placeholder.expands_to), [rows]

    def embedding_width(self, config) -> int:
        """Width of an item's embedding rows as the encoder hands them on (the text model's hidden size)."""
        return config.get_text_config().hidden_size

    def language_model(self, model):
        """The text model that decodes (the batched decoder runs it alone)."""
        return model.model.language_model

    def reset(self, model) -> None:
        """Clear per-request state a transformers model keeps between forward passes."""

    def rope_delta(self, output) -> int:
        """Offset of decode positions from the cache length after a prefill (0 for 1-D positions)."""
        return 0

    def clip_seconds(self, processor, kind: str, items: list) -> list[float] | None:
        """Seconds per temporal patch of each decoded clip, for families whose positions follow time
        (None: the family's positions do not)."""
        return None

    # -- vLLM -------------------------------------------------------------------------------------------
    def vllm_inputs(self, processor, kind: str, items: list) -> list:
        """vLLM's ``multi_modal_data[kind]`` for decoded items (vLLM preprocesses and encodes them itself)."""
        return list(items)

class Unlisted(Family):
    """A model no adapter here lists: its placeholders as its checkpoint says them (:mod:`.checkpoint`). The vllm
    engine serves it from those and vLLM's own processing; the hf engine cannot (it has no encoder call or
    prefill inputs for it)."""

    listed = False

    def __init__(self, model_type: str, placeholders: dict[str, Placeholder]) -> None:
        self.name = self.model_type = model_type
        self.model_class = ""
        self.placeholders = placeholders

    def _hf(self, *args, **kwargs):
        listed = ", ".join(f.model_type for f in FAMILIES.values())
        raise ValueError(f"the hf engine has no family adapter for model type {self.model_type!r} (it has: {listed}); "
                         "serve it with backend: vllm")

    load_model = media_inputs = encode = prefill_inputs = prompt_ids = _hf

    def vllm_inputs(self, processor, kind, items):
        if kind == "video":  # the sampled frames as one (t, h, w, 3) array
            import numpy as np

            return [np.stack(video.frames) for video in items]
        if kind == "audio":
            return [(wave, processor.audio_rate) for wave in items]
        return list(items)


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _discover()


def family_of(config, path=None) -> Family:
    """The family of a transformers config (by ``model_type``); with the checkpoint's ``path``, a model no adapter
    lists is an :class:`Unlisted` one when its chat template marks media."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    supported = ", ".join(f.model_type for f in FAMILIES.values())
    if path is not None:
        from trident.core.families.checkpoint import placeholders_of

        found = placeholders_of(path)
        if found:
            return Unlisted(str(model_type), {kind: Placeholder(text, token or "") for kind, (text, token) in found.items()})
        raise ValueError(f"model type {model_type!r} has no family adapter (they are: {supported}) and its chat template "
                         "marks no image, video or audio part, so its prompts' media cannot be placed")
    raise ValueError(f"unsupported model type {model_type!r}; supported: {supported}")
