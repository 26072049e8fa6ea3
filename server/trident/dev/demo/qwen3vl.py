"""The Qwen3-VL demo: a vision tower of patch 16 with learned, interpolated position embeddings and DeepStack (two
of its middle layers' merged features are added to the first text layers' hidden states at the image tokens) + a
small Qwen3 text model (GQA, QK-norm, interleaved M-RoPE). Tokenizer and chat template are the Qwen2-VL demo's."""

from __future__ import annotations

import json
from pathlib import Path

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder
from trident.dev.demo.qwen2vl import BUILDER as QWEN2VL

PATCH_SIZE = 16
MERGE_SIZE = 2
MIN_PIXELS = 4 * 32 * 32  # 4096 -> at least 4 image tokens
MAX_PIXELS = 256 * 256  # 65536 -> at most 64 image tokens
MEAN = STD = [0.5, 0.5, 0.5]


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import PaddleOCRVLProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from trident.dev.demo.qwen2vl import QWEN2VL_CHAT_TEMPLATE

    hidden, heads, head_dim = 512, 8, 64
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=1024, num_hidden_layers=6,
            num_attention_heads=heads, num_key_value_heads=4, head_dim=head_dim, max_position_embeddings=4096,
            initializer_range=INITIALIZER_RANGE, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True,
                             "mrope_section": [12, 10, 10]},  # (half the head dim: time, height, width)
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_channels=3, patch_size=PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, out_hidden_size=hidden,
            num_position_embeddings=256, deepstack_visual_indexes=[1, 2], initializer_range=INITIALIZER_RANGE,
        ),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE, temporal_patch_size=2,
        merge_size=MERGE_SIZE, image_mean=MEAN, image_std=STD,
    )
    # an image-only processor with Qwen's expansion rule (Qwen3VLProcessor needs a video processor, which needs
    # torchvision): see the Qwen2-VL demo
    processor = PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN2VL_CHAT_TEMPLATE)
    return model, processor


def _after_save(out: Path) -> None:
    """vLLM loads Qwen3-VL through ``Qwen3VLProcessor``, whose video processor must find its config file (written as
    JSON: the class itself needs torchvision to be created). Frames come sampled: it samples none again."""
    config = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": 16 * MAX_PIXELS},
        "patch_size": PATCH_SIZE, "temporal_patch_size": 2, "merge_size": MERGE_SIZE,
        "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": MEAN, "image_std": STD, "do_sample_frames": False,
        "cap_pixels_per_frame": False,
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


BUILDER = DemoBuilder(
    arch="qwen3vl",
    specials=QWEN2VL.specials,
    extra=QWEN2VL.extra,
    token_names=QWEN2VL.token_names,
    build=_build,
    after_save=_after_save,
    describe=(
        f"each image -> (H/32)*(W/32) <|image_pad|> tokens after smart-resize to {MIN_PIXELS}..{MAX_PIXELS} pixels "
        "(256x256 -> 64); DeepStack features ride along in each embedding row"
    ),
)
