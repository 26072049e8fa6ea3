"""InternVL 3 (the hub's ``-hf`` checkpoints): an image is cut into tiles by its aspect (plus a thumbnail when cut),
each tile pixel-shuffled to a fixed number of tokens; ``<IMG_CONTEXT>`` becomes ``<img>``, the image's tokens and
``</img>``, as the processor writes it. Its encoder is transformers' ``get_image_features`` over the tiles; an image's
rows are its tiles' rows in order."""

from __future__ import annotations

from trident.core.families import Family, Placeholder


class InternVL(Family):
    name = "internvl"
    model_type = "internvl"
    model_class = "InternVLForConditionalGeneration"
    placeholders = {"image": Placeholder("<IMG_CONTEXT>", "<IMG_CONTEXT>", "<img><IMG_CONTEXT></img>")}
    rows_joined = True

    def media_inputs(self, processor, kind, items):
        import torch

        out = processor.image_processor(images=items, crop_to_patches=True, return_tensors="pt")  # (its processor's)
        return {"pixel_values": out["pixel_values"], "num_patches": torch.as_tensor(out["num_patches"])}

    def encode(self, model, kind, inputs):
        tiles, _ = super().encode(model, kind, {"pixel_values": inputs["pixel_values"]})
        import torch

        images, at = [], 0
        for n in inputs["num_patches"].tolist():
            images.append(torch.cat(tiles[at:at + n]))
            at += n
        return images, None


FAMILY = InternVL()
