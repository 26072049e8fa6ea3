"""The LLaVA-NeXT demo: CLIP vision tower (112 px tiles, patch 16: 49 tokens per tile) with "anyres" tiling (the
image's base view plus up to four tiles, with a learned newline at the end of each row of tile features) + a
small Llama. The number of ``<image>`` tokens follows the image's size and aspect (a square image: 49 + 196 + 14).

Trident has no family adapter for it (``trident.core.families`` does not list ``llava_next``): it is the demo of a
model served on the vllm engine from what vLLM and the checkpoint say alone."""

from __future__ import annotations

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder
from trident.dev.demo.llava import EXTRA, LLAVA_CHAT_TEMPLATE, SPECIALS, _after_save

TILE = 112
PATCH = 16
PINPOINTS = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE]]


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import (
        CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    vision = CLIPVisionConfig(
        hidden_size=192, intermediate_size=768, projection_dim=192, num_hidden_layers=3, num_attention_heads=4,
        num_channels=3, image_size=TILE, patch_size=PATCH, hidden_act="quick_gelu", initializer_range=INITIALIZER_RANGE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=INITIALIZER_RANGE, rms_norm_eps=1e-5,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], tie_word_embeddings=False,
    )
    config = LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=ids["image"], image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default", vision_feature_layer=-2, projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    with torch.no_grad():  # (the learned row newline starts at zeros otherwise)
        model.model.image_newline.normal_(0.0, INITIALIZER_RANGE)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token="<image>", chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return model, processor


BUILDER = DemoBuilder(
    arch="llava_next",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={"image": "<image>"},
    build=_build,
    after_save=_after_save,
    describe=f"each image -> its {TILE} px base view and up to four tiles, 49 <image> tokens each, plus row newlines",
)
