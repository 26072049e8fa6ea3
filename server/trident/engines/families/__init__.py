"""Model families: what differs between LLaVA, Qwen2-VL and whatever comes next, one adapter file each.

An adapter (a :class:`Family`) holds the prompt placeholder, the vision-tower call, the multimodal inputs
of a transformers prefill and of a vLLM engine. Adding a family is one new module here that defines
``FAMILY`` (plus its demo builder in :mod:`trident.dev.demo`); nothing else chooses by family.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


class Family:
    """The adapter interface; see :mod:`.llava` for a complete one."""

    name: str  # short id ("llava")
    model_type: str  # transformers config ``model_type`` it serves
    placeholder: str  # what a prompt carries once per image
    image_token: str  # the token the placeholder's image part expands into
    model_class: str  # transformers class name of the checkpoint

    def load_model(self, path, dtype):
        import transformers

        return getattr(transformers, self.model_class).from_pretrained(path, dtype=dtype, attn_implementation="sdpa")

    def encode_images(self, model, pixel_inputs: dict) -> tuple[list, list[list[int]] | None]:
        """Run the vision tower + projector: per-image embeddings and the image grids (if the family has them)."""
        raise NotImplementedError

    def image_layout(self, config, image_processor, images: list) -> tuple[list[int], list[list[int]] | None]:
        """Embedding count of each image and the grids, without running the vision tower."""
        raise NotImplementedError

    def prefill_inputs(self, input_ids, image_token_id: int, grid_thw) -> dict[str, Any]:
        """Extra inputs of a transformers forward pass over a prompt with images (beyond the embeddings)."""
        return {}

    def reset(self, model) -> None:
        """Clear per-request state a transformers model keeps between forward passes."""

    def rope_delta(self, output) -> int:
        """Offset of decode positions from the cache length after a prefill (0 for 1-D positions)."""
        return 0

    def vllm_embeddings(self, embeddings, token_counts: list[int], grid_thw) -> dict:
        """vLLM's ``multi_modal_data`` for precomputed image embeddings."""
        import torch

        return {"image": list(torch.split(embeddings, token_counts))}


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _discover()


def family_of(config) -> Family:
    """The family of a transformers config (by ``model_type``)."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    supported = ", ".join(f.model_type for f in FAMILIES.values())
    raise ValueError(f"unsupported model type {model_type!r}; supported: {supported}")
