"""The LLaVA demo: CLIP vision tower (224 px, patch 16: 196 tokens per image) + a small Llama."""

from __future__ import annotations

from pathlib import Path

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder, rename_weights

LLAVA_IMAGE_SIZE = 224
LLAVA_PATCH_SIZE = 16
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2  # 196

SPECIALS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
}
EXTRA = {"image_token": "<image>"}


LLAVA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ ' ' }}{% endif -%}"
    "{%- if message['role'] == 'system' -%}{{ 'SYSTEM: ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'ASSISTANT: ' }}"
    "{%- else -%}{{ 'USER: ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<image>\\n' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' ASSISTANT:' }}{%- endif -%}"
)


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vision = CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=1024,
        projection_dim=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_channels=3,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=LLAVA_PATCH_SIZE,
        hidden_act="quick_gelu",
        initializer_range=INITIALIZER_RANGE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,  # MHA here; the qwen2vl demo covers GQA (4 kv heads)
        max_position_embeddings=4096,
        initializer_range=INITIALIZER_RANGE,
        rms_norm_eps=1e-5,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["image"],
        image_seq_length=LLAVA_IMAGE_TOKENS,
        vision_feature_select_strategy="default",  # drop CLS -> 196 patch features
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token (removed again by "default")
        image_token="<image>",
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return model, processor



def _after_save(folder: Path) -> None:
    """Store LLaVA's CLIP weights as ``vision_tower.vision_model.*`` (the layout of LLaVA checkpoints on the
    hub). transformers 5 saves ``vision_tower.*`` but loads both; vLLM loads only the hub layout."""
    rename_weights(folder, "vision_tower.", "vision_tower.vision_model.")


BUILDER = DemoBuilder(
    arch="llava",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={"image": "<image>"},
    build=_build,
    after_save=_after_save,
    describe=f"each image -> {LLAVA_IMAGE_TOKENS} <image> tokens (images are resized/cropped to 224x224)",
)
