"""Qwen2-VL: a dynamic-resolution vision tower (tokens per image depend on its size) and 3-D M-RoPE
positions, which the decode side continues through the rope delta."""

from __future__ import annotations

from . import Family


class Qwen2VL(Family):
    name = "qwen2vl"
    model_type = "qwen2_vl"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    image_token = "<|image_pad|>"
    model_class = "Qwen2VLForConditionalGeneration"

    def encode_images(self, model, pixel_inputs):
        out = model.model.get_image_features(pixel_inputs["pixel_values"], pixel_inputs["image_grid_thw"], return_dict=True)
        return list(out.pooler_output), pixel_inputs["image_grid_thw"].tolist()

    def image_layout(self, config, image_processor, images):
        grids = image_processor(images=images, return_tensors="pt")["image_grid_thw"].tolist()
        merge = image_processor.merge_size
        return [t * h * w // (merge * merge) for t, h, w in grids], grids

    def prefill_inputs(self, input_ids, image_token_id, grid_thw):
        import torch

        return {
            "image_grid_thw": torch.tensor(grid_thw, dtype=torch.long),
            "mm_token_type_ids": (input_ids == image_token_id).int(),
        }

    def reset(self, model):
        model.model.rope_deltas = None  # stateful in transformers: start each prompt fresh

    def rope_delta(self, output):
        deltas = getattr(output, "rope_deltas", None)
        return 0 if deltas is None else int(deltas.reshape(-1)[0])

    def vllm_embeddings(self, embeddings, token_counts, grid_thw):
        import torch

        return {"image": {"image_embeds": embeddings, "image_grid_thw": torch.tensor(grid_thw)}}


FAMILY = Qwen2VL()
