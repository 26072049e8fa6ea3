"""The Qwen2.5-VL demo: a windowed vision tower (window and full-attention blocks, RMSNorm, SwiGLU) with
timed video positions + a small Qwen2 with GQA and M-RoPE. Tokenizer, chat template and image processor are the
Qwen2-VL demo's (Qwen2.5-VL checkpoints use Qwen2-VL's)."""

from __future__ import annotations

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder
from trident.dev.demo.qwen2vl import BUILDER as QWEN2VL, QWEN_MAX_PIXELS, QWEN_MERGE_SIZE, QWEN_MIN_PIXELS, QWEN_PATCH_SIZE, qwen2_text, windowed_vision


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import PaddleOCRVLProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from trident.dev.demo.qwen2vl import QWEN2VL_CHAT_TEMPLATE

    config = Qwen2_5_VLConfig(
        text_config=qwen2_text(tokenizer, ids), vision_config=windowed_vision(tokens_per_second=2),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS, patch_size=QWEN_PATCH_SIZE, temporal_patch_size=2,
        merge_size=QWEN_MERGE_SIZE,
    )
    # an image-only processor with Qwen's expansion rule: see the Qwen2-VL demo
    processor = PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN2VL_CHAT_TEMPLATE)
    return model, processor


BUILDER = DemoBuilder(
    arch="qwen2_5vl",
    specials=QWEN2VL.specials,
    extra=QWEN2VL.extra,
    token_names=QWEN2VL.token_names,
    build=_build,
    after_save=QWEN2VL.after_save,
    describe=QWEN2VL.describe + "; video positions step 2 per second",
)
