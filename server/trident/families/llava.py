"""LLaVA: CLIP vision tower + projector, ``<image>`` expanded to a fixed number of tokens per image."""

from __future__ import annotations

from . import Family, Placeholder


class LLaVA(Family):
    name = "llava"
    model_type = "llava"
    model_class = "LlavaForConditionalGeneration"
    placeholders = {"image": Placeholder("<image>", "<image>")}

    def encode(self, model, kind, inputs):
        cfg = model.config
        out = model.model.get_image_features(
            pixel_values=inputs["pixel_values"],
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            return_dict=True,
        )
        return list(out.pooler_output), None

FAMILY = LLaVA()
