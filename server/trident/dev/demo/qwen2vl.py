"""The Qwen2-VL demo: a dynamic-resolution vision tower (4..64 tokens per image) + a small Qwen2 with
GQA and M-RoPE."""

from __future__ import annotations

import json
from pathlib import Path

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder

QWEN_PATCH_SIZE = 14
QWEN_MERGE_SIZE = 2
QWEN_MIN_PIXELS = 4 * 28 * 28  # 3136 -> at least 4 image tokens
QWEN_MAX_PIXELS = 224 * 224  # 50176 -> at most 64 image tokens

SPECIALS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
}
EXTRA = {
    "im_start_token": "<|im_start|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}


def qwen_chat_template(media_rules: str) -> str:
    """Qwen's ChatML template (a default system prompt, ``<|im_start|>role ... <|im_end|>``); ``media_rules``
    renders the family's media parts (Jinja ``elif`` branches over ``item``), text parts are rendered as text."""
    return (
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'text' -%}{{ item['text'] }}"
        + media_rules +
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


QWEN2VL_CHAT_TEMPLATE = qwen_chat_template(
    "{%- elif item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
)


def qwen2_text(tokenizer, ids: dict[str, int]) -> dict:
    """The Qwen demos' text model: a small Qwen2 with GQA and M-RoPE (head dim 64: rotary half 32 = 16 + 8 + 8)."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096, initializer_range=INITIALIZER_RANGE, rms_norm_eps=1e-6,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 8, 8]},
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], tie_word_embeddings=False,
    )


def windowed_vision(**more) -> dict:
    """The Qwen2.5-VL (and Qwen2.5-Omni) demos' vision tower: window and full-attention blocks, out to the text size."""
    return dict(
        depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_channels=3, patch_size=QWEN_PATCH_SIZE,
        spatial_merge_size=QWEN_MERGE_SIZE, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
        out_hidden_size=512, initializer_range=INITIALIZER_RANGE, **more,
    )


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import PaddleOCRVLProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2VLConfig(
        text_config=qwen2_text(tokenizer, ids),
        vision_config=dict(
            depth=4,
            embed_dim=128,
            hidden_size=512,  # output size of the patch merger = text hidden size
            mlp_ratio=4,
            num_heads=4,
            in_channels=3,
            patch_size=QWEN_PATCH_SIZE,
            spatial_merge_size=QWEN_MERGE_SIZE,
            temporal_patch_size=2,
            initializer_range=INITIALIZER_RANGE,
        ),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
        patch_size=QWEN_PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=QWEN_MERGE_SIZE,
    )
    # NOTE: transformers 5.x ``Qwen2VLProcessor`` has a mandatory video processor, and every
    # video processor needs torchvision (not installed here).  ``PaddleOCRVLProcessor`` is a
    # built-in, image-only processor with the exact same expansion rule
    # (``<|image_pad|>`` * grid_t*grid_h*grid_w // merge_size**2, ``tokenizer.image_token``) and it
    # returns the same tensors (input_ids, attention_mask, mm_token_type_ids, pixel_values,
    # image_grid_thw), so AutoProcessor can load it without torchvision.
    processor = PaddleOCRVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=QWEN2VL_CHAT_TEMPLATE,
    )
    return model, processor



def _after_save(out: Path) -> None:
    """vLLM loads Qwen2-VL through ``Qwen2VLProcessor``, whose video processor must find its config file.
    Written as JSON because the video processor class itself needs torchvision to be created."""
    config = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS},
        "patch_size": QWEN_PATCH_SIZE,
        "temporal_patch_size": 2,
        "merge_size": QWEN_MERGE_SIZE,
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")




BUILDER = DemoBuilder(
    arch="qwen2vl",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={
        "im_start": "<|im_start|>", "im_end": "<|im_end|>", "vision_start": "<|vision_start|>",
        "vision_end": "<|vision_end|>", "image": "<|image_pad|>", "video": "<|video_pad|>",
    },
    build=_build,
    after_save=_after_save,
    describe=(
        "each image -> (H/28)*(W/28) <|image_pad|> tokens after smart-resize to "
        f"{QWEN_MIN_PIXELS}..{QWEN_MAX_PIXELS} pixels (224x224 -> 64, 300x200 -> 54)"
    ),
)
