"""The Gemma 3 demo: a SigLIP vision tower (112 px, patch 14: 8x8 patches pooled to 4x4) + a small Gemma 3 text
model (sliding-window and global layers, GQA, QK-norm). Each image is ``<start_of_image>`` in the prompt, which the
processor expands to ``\\n\\n<start_of_image>`` + 16 ``<image_soft_token>`` + ``<end_of_image>\\n\\n``; the image's
tokens attend to each other both ways.

The hf engine serves it through ``trident.core.families.gemma3``; the vllm engine from what vLLM says alone."""

from __future__ import annotations

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder
from trident.dev.demo.llava import _after_save as _hub_vision_layout

IMAGE_SIZE = 112
PATCH = 14
TOKENS_PER_IMAGE = 16

SPECIALS = {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
EXTRA = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
    "start_of_turn": "<start_of_turn>",
    "end_of_turn": "<end_of_turn>",
}

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
            max_position_embeddings=4096, sliding_window=512, initializer_range=INITIALIZER_RANGE,
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
            patch_size=PATCH, vision_use_head=False, initializer_range=INITIALIZER_RANGE,
        ),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids["boi"], eoi_token_index=ids["eoi"],
        image_token_index=ids["image"], initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False,  # (tied: one token forever)
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # (transformers starts the projector at zeros: every image would look the same)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, INITIALIZER_RANGE)
    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE,
                                image_seq_length=TOKENS_PER_IMAGE)
    return model, processor


BUILDER = DemoBuilder(
    arch="gemma3",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={"boi": "<start_of_image>", "eoi": "<end_of_image>", "image": "<image_soft_token>"},
    build=_build,
    after_save=_hub_vision_layout,  # (SigLIP's weights under vision_tower.vision_model.*, as vLLM loads them)
    # (Gemma's tokenizer has runs of newlines as tokens, and vLLM's Gemma 3 processor joins the ones its image
    # expansion writes next to the prompt's by them)
    added=("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
    describe=f"each image (resized to {IMAGE_SIZE}x{IMAGE_SIZE}) -> <start_of_image> + {TOKENS_PER_IMAGE} image tokens + <end_of_image>",
)
