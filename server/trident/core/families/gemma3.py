"""Gemma 3 (its encoder: transformers' ``get_image_features``): a SigLIP tower pooled to a fixed number of tokens per image (``mm_tokens_per_image``), whose image tokens
attend to each other both ways in the prefill. The prompt's ``<start_of_image>`` becomes newlines, the start token,
the image's ``<image_soft_token>`` s and the end token (the processor's ``full_image_sequence``); its text layers
alternate sliding-window and global attention (the decoder masks each kind as its layers need)."""

from __future__ import annotations

from trident.core.families import Family, Placeholder


class Gemma3(Family):
    name = "gemma3"
    model_type = "gemma3"
    model_class = "Gemma3ForConditionalGeneration"
    placeholders = {"image": Placeholder("<start_of_image>", "<image_soft_token>",
                                         "\n\n<start_of_image><image_soft_token><end_of_image>\n\n")}

    rows_joined = True

    def prefill_inputs(self, model, input_ids, media, token_ids):
        kwargs = super().prefill_inputs(model, input_ids, media, token_ids)
        kwargs["token_type_ids"] = (input_ids == token_ids["image"]).long()  # (image tokens attend both ways)
        return kwargs


FAMILY = Gemma3()
