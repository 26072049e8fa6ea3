"""The Qwen2.5-VL demo: a windowed vision tower (window and full-attention blocks, RMSNorm, SwiGLU) with
timed video positions + a small Qwen2 with GQA and M-RoPE. Tokenizer, chat template and image processor are the
Qwen2-VL demo's (Qwen2.5-VL checkpoints use Qwen2-VL's)."""

from __future__ import annotations

from . import INITIALIZER_RANGE, DemoBuilder
from .qwen2vl import BUILDER as QWEN2VL, QWEN_MAX_PIXELS, QWEN_MERGE_SIZE, QWEN_MIN_PIXELS, QWEN_PATCH_SIZE


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import PaddleOCRVLProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .qwen2vl import QWEN2VL_CHAT_TEMPLATE

    hidden, heads = 512, 8
    head_dim = hidden // heads
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=1024, num_hidden_layers=6,
            num_attention_heads=heads, num_key_value_heads=4, max_position_embeddings=4096,
            initializer_range=INITIALIZER_RANGE, rms_norm_eps=1e-6, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]},
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_channels=3,
            patch_size=QWEN_PATCH_SIZE, spatial_merge_size=QWEN_MERGE_SIZE, temporal_patch_size=2,
            window_size=112, fullatt_block_indexes=[1, 3], out_hidden_size=hidden, tokens_per_second=2,
            initializer_range=INITIALIZER_RANGE,
        ),
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
