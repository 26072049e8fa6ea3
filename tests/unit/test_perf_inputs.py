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
