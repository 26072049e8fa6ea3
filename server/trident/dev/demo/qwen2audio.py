"""The Qwen2-Audio demo: a small Whisper-style audio encoder (128 mel bins, the real 30 s window) + projector
+ a small Qwen2 text model. A clip of s seconds becomes about 25*s ``<|AUDIO|>`` tokens (30 s: 750)."""

from __future__ import annotations

from pathlib import Path

from trident.dev.demo import INITIALIZER_RANGE, DemoBuilder, rename_weights
from trident.dev.demo.qwen2vl import SPECIALS, qwen_chat_template

EXTRA = {
    "im_start_token": "<|im_start|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "audio_token": "<|AUDIO|>",
}

# Qwen2-Audio-Instruct's template, reduced: "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\n" per clip.
QWEN2AUDIO_CHAT_TEMPLATE = "{%- set audio_count = namespace(value=0) -%}" + qwen_chat_template(
    "{%- elif item['type'] in ['audio', 'audio_url', 'input_audio'] or 'audio_url' in item -%}"
    "{%- set audio_count.value = audio_count.value + 1 -%}"
    "{{ 'Audio ' + audio_count.value|string + ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' }}"
)


def _build(tokenizer, ids: dict[str, int], seed: int):
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor
    from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor

    hidden = 512
    config = Qwen2AudioConfig(
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=256,
            d_model=64,
            max_source_positions=1500,  # 30 s of 10 ms frames, halved by the second conv
            initializer_range=INITIALIZER_RANGE,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            initializer_range=INITIALIZER_RANGE,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
            tie_word_embeddings=False,
        ),
        audio_token_index=ids["audio"],
        tie_word_embeddings=False,
    )
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config)
    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30)
    processor = Qwen2AudioProcessor(
        feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=QWEN2AUDIO_CHAT_TEMPLATE,
    )
    return model, processor


def _after_save(folder: Path) -> None:
    """transformers 5 saves the text model as ``language_model.model.model.*``; the hub's (and vLLM's) layout
    is ``language_model.model.*``. transformers loads both."""
    rename_weights(folder, "language_model.model.model.", "language_model.model.")


BUILDER = DemoBuilder(
    arch="qwen2audio",
    specials=SPECIALS,
    extra=EXTRA,
    token_names={
        "im_start": "<|im_start|>", "im_end": "<|im_end|>", "audio_bos": "<|audio_bos|>",
        "audio_eos": "<|audio_eos|>", "audio": "<|AUDIO|>",
    },
    build=_build,
    after_save=_after_save,
    describe="each audio clip (16 kHz, at most 30 s) -> ~25 <|AUDIO|> tokens per second (2 s -> 50, 30 s -> 750)",
)
