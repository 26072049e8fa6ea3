"""What every mode must reproduce: transformers' ``model.generate()`` on the same checkpoint."""

from __future__ import annotations

import torch

from .media import b64, chat_prompt, make_image, png_bytes

PROMPT = "Describe the picture in detail, please."


def build_reference(model_path: str, specs_by_case: dict, new_tokens: int) -> dict:
    """The prompt, images and model.generate() text of each case (image specs ``(w, h, seed)``)."""
    from transformers import AutoProcessor

    from trident.engines.hf.model import load_model

    model, processor = load_model(model_path), AutoProcessor.from_pretrained(model_path)
    cases = {}
    for case, specs in specs_by_case.items():
        images = [make_image(*s) for s in specs]
        text = chat_prompt(processor.tokenizer, len(images), PROMPT)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        cases[case] = {
            "text": text,
            "images": [b64(png_bytes(i)) for i in images],
            "pngs": [png_bytes(i) for i in images],
            "ids": ids,
            "expected": processor.tokenizer.decode(ids, skip_special_tokens=True),
            "num_input_tokens": inputs["input_ids"].shape[1],
        }
    return cases
