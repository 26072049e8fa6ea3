"""The InternVL 3 demo (the hub's ``-hf`` layout): an InternViT tower on 112 px tiles, pixel-shuffled 2x2 to 16 tokens a
tile, + a small Qwen2 text model. An image is cut into up to 4 tiles by its aspect, plus a thumbnail when it is cut;
``<IMG_CONTEXT>`` in the prompt becomes ``<img>``, 16 tokens per tile and ``</img>``."""

from __future__ import annotations

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder, ProcessorFiles
from trident.dev.demo.qwen2vl import SPECIALS, qwen_chat_template

TILE = 112
PATCH = 14
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2  # 16
MAX_TILES = 4
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]

EXTRA = {
    "im_start_token": "<|im_start|>",
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

INTERNVL_CHAT_TEMPLATE = qwen_chat_template(
    "{%- elif item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<IMG_CONTEXT>\\n' }}"
)


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    hidden = 512
    config = InternVLConfig(
        vision_config=dict(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=[TILE, TILE],
            patch_size=[PATCH, PATCH], initializer_range=INITIALIZER_RANGE,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=1024, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, initializer_range=INITIALIZER_RANGE,
            rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
            pad_token_id=ids["pad"], tie_word_embeddings=False,
        ),
        image_token_id=ids["context"], image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5,
        initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=MAX_TILES,
        image_mean=MEAN, image_std=STD,
    )
    video = {
        "video_processor_type": "InternVLVideoProcessor", "size": {"height": TILE, "width": TILE}, "do_resize": True,
        "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": MEAN,
        "image_std": STD, "do_convert_rgb": True,
    }
    # (InternVLProcessor needs its video processor, which needs torchvision: its files are written without it)
    return model, ProcessorFiles(tokenizer, INTERNVL_CHAT_TEMPLATE, "InternVLProcessor",
                                 {"image_processor": image_processor}, video, {"image_seq_length": TOKENS_PER_TILE})


BUILDER = DemoBuilder(
    arch="internvl",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={"im_start": "<|im_start|>", "im_end": "<|im_end|>", "start": "<img>", "end": "</img>",
                 "context": "<IMG_CONTEXT>", "video": "<video>"},
    build=_build,
    describe=(f"each image -> <img> + {TOKENS_PER_TILE} <IMG_CONTEXT> tokens per {TILE} px tile (1 tile, or up to "
              f"{MAX_TILES} by its aspect plus a thumbnail) + </img>"),
)
