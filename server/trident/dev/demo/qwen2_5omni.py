"""The Qwen2.5-Omni demo, its thinker: a windowed vision tower (images and video, timed M-RoPE positions 25 a second)
and a Whisper-style audio encoder (128 mel bins, windows of 2 s) in front of a small Qwen2.5 text model. Saved as the
hub's checkpoints are (``Qwen2_5OmniForConditionalGeneration``, the thinker's weights under ``thinker.``), without a
talker (``enable_audio_output: false``): Trident serves text out."""

from __future__ import annotations

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder, ProcessorFiles
from trident.dev.demo.qwen2vl import SPECIALS, qwen2_text, qwen_chat_template, windowed_vision

PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 224 * 224
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]

EXTRA = {
    "im_start_token": "<|im_start|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

# Qwen2.5-Omni's template, reduced to its media parts
OMNI_CHAT_TEMPLATE = qwen_chat_template(
    "{%- elif item['type'] in ['image', 'image_url'] or 'image' in item or 'image_url' in item -%}"
    "{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{ '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{%- elif item['type'] in ['audio', 'audio_url', 'input_audio'] or 'audio_url' in item -%}"
    "{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
)


VIDEO_CONFIG = {
    "video_processor_type": "Qwen2VLVideoProcessor", "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    "patch_size": PATCH_SIZE, "temporal_patch_size": 2, "merge_size": MERGE_SIZE, "do_convert_rgb": True,
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": MEAN, "image_std": STD,
}


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor

    thinker = dict(
        text_config=qwen2_text(tokenizer, ids), vision_config=windowed_vision(),
        audio_config=dict(
            num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256, d_model=64,
            max_source_positions=1500, n_window=100, output_dim=512, initializer_range=INITIALIZER_RANGE,
        ),
        audio_token_index=ids["audio"], image_token_index=ids["image"], video_token_index=ids["video"],
        audio_start_token_id=ids["audio_bos"], audio_end_token_id=ids["audio_eos"],
        vision_start_token_id=ids["vision_bos"], vision_end_token_id=ids["vision_eos"], user_token_id=ids["im_start"],
        initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False,
    )
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                               temporal_patch_size=2, merge_size=MERGE_SIZE, image_mean=MEAN, image_std=STD)
    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30)
    return model, ProcessorFiles(tokenizer, OMNI_CHAT_TEMPLATE, "Qwen2_5OmniProcessor",
                                 {"image_processor": image_processor, "feature_extractor": feature_extractor}, VIDEO_CONFIG)


BUILDER = DemoBuilder(
    arch="qwen2_5omni",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={
        "im_start": "<|im_start|>", "im_end": "<|im_end|>", "image": "<|IMAGE|>", "video": "<|VIDEO|>",
        "audio": "<|AUDIO|>", "vision_bos": "<|vision_bos|>", "vision_eos": "<|vision_eos|>",
        "audio_bos": "<|audio_bos|>", "audio_eos": "<|audio_eos|>",
    },
    build=_build,
    describe=("each image -> (H/28)*(W/28) <|IMAGE|> tokens (224x224 -> 64); a clip -> its patches' <|VIDEO|> tokens; "
              "an audio clip (16 kHz, at most 30 s) -> ~25 <|AUDIO|> tokens per second"),
)
