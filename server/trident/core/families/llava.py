"""LLaVA: CLIP vision tower + projector, ``<image>`` expanded to a fixed number of tokens per image."""

from __future__ import annotations

from trident.core.families import Family, Placeholder


class LLaVA(Family):
    name = "llava"
    model_type = "llava"
    model_class = "LlavaForConditionalGeneration"
    placeholders = {"image": Placeholder("<image>", "<image>")}


FAMILY = LLaVA()
