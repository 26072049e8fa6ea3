"""The perf_analyzer input generator writes what the entry models take."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "perf"))

from make_inputs import perf_analyzer_inputs  # noqa: E402


def test_inputs_have_images_of_the_asked_size_and_count():
    doc = perf_analyzer_inputs("qwen2vl", 2, (320, 240), 3, {"max_tokens": 8})
    assert len(doc["data"]) == 3
    entry = doc["data"][0]
    assert entry["text_input"][0].count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert entry["image"]["shape"] == [2] and len(entry["image"]["content"]) == 2
    img = Image.open(io.BytesIO(base64.b64decode(entry["image"]["content"][0])))
    assert img.size == (320, 240)
    assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 8}
    assert doc["data"][0]["image"]["content"][0] != doc["data"][1]["image"]["content"][0]
    text_only = perf_analyzer_inputs("llava", 0, (1, 1), 1, {})
    assert "image" not in text_only["data"][0] and "<image>" not in text_only["data"][0]["text_input"][0]


def test_inputs_can_carry_video_and_audio_clips():
    import soundfile

    from trident.core.media import MediaItem

    video = perf_analyzer_inputs("qwen2vl", 0, (64, 48), 2, {}, n_videos=1, frames=6)
    entry = video["data"][0]
    assert entry["text_input"][0].count("<|vision_start|><|video_pad|><|vision_end|>") == 1 and "image" not in entry
    clip = MediaItem(base64.b64decode(entry["video"]["content"][0]), 0, "video").open()
    assert len(clip.frames) == 6 and clip.frames[0].shape == (48, 64, 3)
    assert video["data"][1]["video"]["content"] != entry["video"]["content"]
    audio = perf_analyzer_inputs("qwen2audio", 0, (1, 1), 1, {}, n_audios=2, seconds=1.5)["data"][0]
    assert audio["text_input"][0].count("<|audio_bos|><|AUDIO|><|audio_eos|>") == 2 and audio["audio"]["shape"] == [2]
    info = soundfile.info(io.BytesIO(base64.b64decode(audio["audio"]["content"][1])))
    assert (info.samplerate, info.frames) == (16000, 24000)
