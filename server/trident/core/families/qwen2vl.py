"""Qwen2-VL: a dynamic-resolution vision tower for images and video (tokens per item depend on its size and,
for video, its frame count) and 3-D M-RoPE positions, which the decode side continues through the rope
delta."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trident.core.families import Family, Placeholder


class Qwen2VL(Family):
    name = "qwen2vl"
    model_type = "qwen2_vl"
    model_class = "Qwen2VLForConditionalGeneration"
    placeholders = {
        "image": Placeholder("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>"),
        "video": Placeholder("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>"),
    }

    # -- media ------------------------------------------------------------------------------------------
    def media_inputs(self, processor, kind, items):
        if kind == "image":
            return super().media_inputs(processor, kind, items)
        pixels, grids = zip(*(video_patches(processor, video.frames, self.frame_size) for video in items))
        import torch

        return {"pixel_values_videos": torch.from_numpy(np.concatenate(pixels)), "video_grid_thw": torch.tensor(grids)}

    def frame_size(self, processor, frames: list) -> tuple[int, int]:
        """A clip's (height, width) once resized: each frame's pixels within the video processor's bounds."""
        return frame_size(processor, frames)

    # -- prefill -----------------------------------------------------------------------------------------
    def prefill_inputs(self, model, input_ids, media, token_ids):
        check_grids(model, media)
        return super().prefill_inputs(model, input_ids, media, token_ids)

    def reset(self, model):
        model.model.rope_deltas = None  # stateful in transformers: start each prompt fresh

    def rope_delta(self, output):
        deltas = getattr(output, "rope_deltas", None)
        return 0 if deltas is None else int(deltas.reshape(-1)[0])

    def vllm_inputs(self, processor, kind, items):
        if kind == "video":
            # the sampled frames, (t, h, w, 3) uint8 per clip, already resized as video_patches resizes them:
            # vLLM's (torchvision) resize to the same size then changes nothing, so a clip gives the same
            # pixels, hence embeddings, whether vLLM or the encode worker encodes it
            return [np.stack(resized_frames(processor, video.frames, self.frame_size)) for video in items]
        return list(items)

def check_grids(model, media) -> None:
    """Each image's and clip's grid must be the one its rows came from (its positions follow it)."""
    from trident.core.errors import InvalidRequest

    merge = model.config.vision_config.spatial_merge_size
    for kind, (rows, grids) in media.by_kind().items():
        if kind not in ("image", "video"):
            continue
        for row, grid in zip(rows, grids or ()):
            if len(grid) != 3 or grid[0] * grid[1] * grid[2] != row.shape[0] * merge * merge:
                raise InvalidRequest(f"a {kind}'s grid {grid} does not give its {row.shape[0]} embedding rows")


# -- video preprocessing without torchvision ---------------------------------------------------------------
# transformers' Qwen2-VL video processor needs torchvision, which has no CPU build on PyPI. A clip is
# preprocessed here with the (PIL) image processor instead: every frame resized to the clip's size,
# rescaled and normalized as an image, then consecutive frames paired into temporal patches, in the video
# processor's layout ((t, h/m, w/m, m, m) patches of (channel, time, patch, patch)).
def video_size(processor) -> tuple[int, int]:
    """(min, max) pixels per frame: the checkpoint's video processor settings, else its image processor's."""
    cached = getattr(processor, "_video_size", None)
    if cached is None:
        ip = processor.image_processor
        lo, hi = ip.size["shortest_edge"], ip.size["longest_edge"]
        path = Path(processor.path) / "video_preprocessor_config.json"
        if path.is_file():
            cfg = json.loads(path.read_text())
            size = cfg.get("size") or {}
            lo = cfg.get("min_pixels") or size.get("shortest_edge") or lo
            hi = cfg.get("max_pixels") or size.get("longest_edge") or hi
        cached = processor._video_size = (int(lo), int(hi))
    return cached


def frame_size(processor, frames: list) -> tuple[int, int]:
    """A clip's frame size by Qwen2-VL's rule: each frame's pixels within the video processor's bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ip = processor.image_processor
    lo, hi = video_size(processor)
    return smart_resize(*frames[0].shape[:2], factor=ip.patch_size * ip.merge_size, min_pixels=lo, max_pixels=hi)


def resized_frames(processor, frames: list, size=frame_size) -> list[np.ndarray]:
    """A clip's frames resized (PIL, the image processor's filter) to the clip's patch-aligned size (``size``: the
    family's rule, from the processor and the frames)."""
    from PIL import Image

    height, width = size(processor, frames)
    if frames[0].shape[:2] == (height, width):
        return list(frames)
    resample = processor.image_processor.resample
    return [np.asarray(Image.fromarray(f).resize((width, height), resample=resample)) for f in frames]


def video_patches(processor, frames: list, size=frame_size) -> tuple[np.ndarray, list[int]]:
    """A clip's ``pixel_values_videos`` rows and its (t, h, w) grid (``size``: see :func:`resized_frames`)."""
    ip = processor.image_processor
    resized = resized_frames(processor, frames, size)
    out = ip(images=resized, do_resize=False, temporal_patch_size=1, return_tensors="np")
    rows, grid = out["pixel_values"], out["image_grid_thw"]
    tp, (_, gh, gw) = ip.temporal_patch_size, grid[0]
    count = len(frames)
    per_frame = rows.reshape(count, gh * gw, -1)
    if pad := -count % tp:  # the last frame repeated up to a whole temporal patch (as the video processor does)
        per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
    t = per_frame.shape[0] // tp
    patch = ip.patch_size
    # (t*tp, n, C*p*p) -> (t, tp, n, C, p, p) -> (t, n, C, tp, p, p) -> (t*n, C*tp*p*p)
    x = per_frame.reshape(t, tp, gh * gw, -1, patch, patch).transpose(0, 2, 3, 1, 4, 5)
    return np.ascontiguousarray(x.reshape(t * gh * gw, -1)), [t, int(gh), int(gw)]


FAMILY = Qwen2VL()
