"""Qwen2.5-VL: Qwen2-VL's placeholders, preprocessing and M-RoPE, with a windowed vision tower and temporal
positions that follow time: a video's temporal patches are ``tokens_per_second * seconds_per_patch`` positions
apart, so each clip carries its sampling interval (``second_per_grid_ts``) to the prefill."""

from __future__ import annotations

from trident.core.families.qwen2vl import Qwen2VL


class Qwen25VL(Qwen2VL):
    name = "qwen2_5vl"
    model_type = "qwen2_5_vl"
    model_class = "Qwen2_5_VLForConditionalGeneration"

    def media_inputs(self, processor, kind, items):
        out = super().media_inputs(processor, kind, items)
        if kind == "video":
            out["second_per_grid_ts"] = self.clip_seconds(processor, kind, items)
        return out

    def clip_seconds(self, processor, kind, items):
        if kind != "video":
            return None
        return [processor.image_processor.temporal_patch_size / video.fps for video in items]

    def prefill_inputs(self, model, input_ids, media, token_ids):
        import torch

        kwargs = super().prefill_inputs(model, input_ids, media, token_ids)
        seconds = _video_seconds(media)
        if seconds:
            kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32, device=input_ids.device)
        return kwargs

    def vllm_inputs(self, processor, kind, items):
        frames = super().vllm_inputs(processor, kind, items)
        if kind != "video":
            return frames
        # vLLM's Qwen2.5-VL takes a clip with its metadata: the sampling rate gives its seconds per temporal
        # patch (frames already sampled: vLLM samples none again)
        return [with_metadata(clip, video) for clip, video in zip(frames, items)]


def with_metadata(clip, video) -> tuple:
    """A sampled clip (a ``(t, h, w, 3)`` array) as vLLM's Qwen processors take it: with its sampling rate, which
    places its frames in time (they come sampled: vLLM samples none again)."""
    return (clip, {"fps": video.fps, "duration": video.duration, "total_num_frames": len(clip),
                   "frames_indices": list(range(len(clip))), "video_backend": "pyav", "do_sample_frames": False})


def _video_seconds(media) -> list[float]:
    """Seconds per temporal patch of a request's clips (a MediaEmbeddings), in order; empty without them."""
    return [s for kind, s in zip(media.item_kinds, media.seconds or []) if kind == "video"]


FAMILY = Qwen25VL()
