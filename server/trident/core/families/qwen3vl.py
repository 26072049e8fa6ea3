"""Qwen3-VL: Qwen2-VL's placeholders and M-RoPE (interleaved), a patch-16 vision tower and DeepStack: besides its
output, the tower hands on the merged features of some of its middle layers, which the first text layers add to
their hidden states at the media tokens. An item's embedding row is its output and then each DeepStack feature,
side by side (``hidden * (1 + layers)`` wide, the layout vLLM's encoder hands on), so they cross stages as one."""

from __future__ import annotations

import json
from pathlib import Path

from trident.core.families import Placeholder
from trident.core.families.qwen2vl import Qwen2VL


class Qwen3VL(Qwen2VL):
    name = "qwen3vl"
    model_type = "qwen3_vl"
    model_class = "Qwen3VLForConditionalGeneration"
    placeholders = {
        "image": Qwen2VL.placeholders["image"],
        "video": Placeholder("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>", timed=True),
    }

    # -- media ------------------------------------------------------------------------------------------
    def media_inputs(self, processor, kind, items):
        out = super().media_inputs(processor, kind, items)
        if kind == "video":
            out["second_per_grid_ts"] = self.clip_seconds(processor, kind, items)
        return out

    def frame_size(self, processor, frames):
        """Qwen3-VL's rule: the clip's pixel budget is the whole clip's."""
        return _frame_size(processor, frames)

    def clip_seconds(self, processor, kind, items):
        return [processor.image_processor.temporal_patch_size / video.fps for video in items] if kind == "video" else None

    def item_text(self, kind, rows, grid, seconds, frames):
        """A clip's token becomes one run per temporal patch, each after that patch's time: the mean of its frames'
        times (the last patch repeats the clip's last frame), as Qwen3-VL's processor writes it (inside the
        placeholder's own start and end)."""
        if kind != "video":
            return super().item_text(kind, rows, grid, seconds, frames)
        t = grid[0]
        step = seconds / 2  # (seconds per frame: patches of 2 frames)
        last = frames - 1
        times = [(min(2 * j, last) + min(2 * j + 1, last)) / 2 * step for j in range(t)]
        runs = "".join(f"<{when:.1f} seconds><|vision_start|><|video_pad|><|vision_end|>" for when in times)
        return f"<|vision_start|>{runs}<|vision_end|>", [rows // t] * t

    def embedding_width(self, config) -> int:
        return config.text_config.hidden_size * (1 + len(config.vision_config.deepstack_visual_indexes))

    def encode(self, model, kind, inputs):
        import torch

        pixels, grids = (inputs["pixel_values"], inputs["image_grid_thw"]) if kind == "image" else (
            inputs["pixel_values_videos"], inputs["video_grid_thw"])
        out = model.model.get_image_features(pixels, grids, return_dict=True)  # (videos: the same tower)
        rows = [torch.cat([main, *(layer[i] for layer in out.deepstack_features)], dim=-1)
                for i, main in enumerate(out.pooler_output)]
        return rows, grids.tolist()

    def prefill_inputs(self, model, input_ids, media, token_ids):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        kwargs = super().prefill_inputs(model, input_ids, media, token_ids)
        hidden = model.config.text_config.hidden_size
        outputs = {}
        for kind, (rows, _) in media.by_kind().items():
            parts = [row.split(hidden, dim=-1) for row in rows]  # per item: output, then each DeepStack layer's
            outputs[kind] = BaseModelOutputWithDeepstackFeatures(
                pooler_output=[p[0] for p in parts],
                deepstack_features=[[p[layer] for p in parts] for layer in range(1, len(parts[0]))],
            )
        kwargs["mm_encoder_outputs"] = outputs
        return kwargs

    def vllm_inputs(self, processor, kind, items):
        if kind != "video":
            return list(items)
        import numpy as np

        from trident.core.families.qwen2_5vl import with_metadata

        # (vLLM resizes a clip by Qwen3-VL's rule, and writes each temporal patch's time in the prompt from the rate)
        return [with_metadata(np.stack(video.frames), video) for video in items]


def _frame_size(processor, frames: list) -> tuple[int, int]:
    """A clip's frame size by Qwen3-VL's video rule: its pixel budget is the whole clip's."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from trident.core.families.qwen2vl import video_size

    ip = processor.image_processor
    lo, hi = video_size(processor)
    count, factor = max(len(frames), ip.temporal_patch_size), ip.patch_size * ip.merge_size
    path = Path(processor.path) / "video_preprocessor_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("cap_pixels_per_frame"):  # (each frame's share of the budget, within its token ceiling)
        per_frame = max(min(config.get("max_video_tokens", 768) * factor * factor, hi // count), int(lo * 1.05))
        hi = per_frame * count
    height, width = frames[0].shape[:2]
    return smart_resize(count, height, width, temporal_factor=ip.temporal_patch_size, factor=factor, min_pixels=lo,
                        max_pixels=hi)


FAMILY = Qwen3VL()
