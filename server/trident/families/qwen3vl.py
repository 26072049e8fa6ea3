"""Qwen3-VL: Qwen2-VL's placeholders and M-RoPE (interleaved), a patch-16 vision tower and DeepStack: besides its
output, the tower hands on the merged features of some of its middle layers, which the first text layers add to
their hidden states at the media tokens. An item's embedding row is its output and then each DeepStack feature,
side by side (``hidden * (1 + layers)`` wide, the layout vLLM's encoder hands on), so they cross stages as one."""

from __future__ import annotations

from .qwen2vl import Qwen2VL


class Qwen3VL(Qwen2VL):
    name = "qwen3vl"
    model_type = "qwen3_vl"
    model_class = "Qwen3VLForConditionalGeneration"

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


FAMILY = Qwen3VL()
