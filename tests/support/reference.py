"""What every mode must reproduce: transformers' ``model.generate()`` on the same checkpoint."""

from __future__ import annotations

import numpy as np
import torch

from .media import b64, chat_prompt, decoded_frames, make_image, media_prompt, png_bytes

PROMPT = "Describe the picture in detail, please."


def build_reference(model_path: str, specs_by_case: dict, new_tokens: int, prompts: dict | None = None) -> dict:
    """The prompt, images and model.generate() text of each case (image specs ``(w, h, seed)``; the user's
    text is ``prompts[case]``, or :data:`PROMPT`)."""
    from transformers import AutoProcessor

    from trident.worker.engines.hf.stage import load_model

    model, processor = load_model(model_path), AutoProcessor.from_pretrained(model_path)
    cases = {}
    for case, specs in specs_by_case.items():
        images = [make_image(*s) for s in specs]
        text = chat_prompt(processor.tokenizer, len(images), (prompts or {}).get(case, PROMPT))
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        cases[case] = {
            # each step's log-softmax of the raw logits (what a logprob entry holds)
            "logprobs": [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits],
            "text": text,
            "images": [b64(png_bytes(i)) for i in images],
            "pngs": [png_bytes(i) for i in images],
            "ids": ids,
            "expected": processor.tokenizer.decode(ids, skip_special_tokens=True),
            "num_input_tokens": inputs["input_ids"].shape[1],
        }
    return cases


MEDIA_PROMPT = "What happens in it?"


def build_media_reference(model_path: str, cases: dict, new_tokens: int) -> dict:
    """``model.generate()`` on each case's media, prepared without Trident's request path.

    A case is a list of ``(kind, bytes)``. Audio goes through the checkpoint's own processor
    (``Qwen2AudioProcessor``) from the clip's samples. Video: transformers' Qwen2-VL video processor needs
    torchvision (no CPU build), so the clip's frames (all of them: the test clips are made at the server's
    sampling rate) are patched by Trident's ``video_patches``, which a unit test holds to the image processor's
    layout; the prompt is expanded here from the grid."""
    import soundfile
    import io

    from transformers import AutoProcessor

    from trident.core.families.qwen2vl import video_patches
    from trident.worker.engines.hf.stage import load_model
    from trident.core.processor import Processor

    model, ours = load_model(model_path), Processor(model_path)
    # (Qwen2.5-Omni's processor needs torchvision for its video processor: its inputs are made without it)
    processor = AutoProcessor.from_pretrained(model_path) if ours.family.name != "qwen2_5omni" else None
    tok = ours.tokenizer
    out = {}
    for case, items in cases.items():
        kinds = [kind for kind, _ in items]
        text = media_prompt(tok, kinds, MEDIA_PROMPT)
        media = {k: [b64(raw) for kk, raw in items if kk == k] for k in dict.fromkeys(kinds)}
        if ours.family.name == "qwen2audio":
            waves = [soundfile.read(io.BytesIO(raw), dtype="float32")[0] for _, raw in items]
            inputs = processor(text=[text], audio=waves or None, sampling_rate=16000, return_tensors="pt")
        else:  # (each family's frame size: Qwen3-VL's budget is the whole clip's, Qwen2.5-Omni's bounds its processor's)
            patches = lambda p, frames: video_patches(p, frames, ours.family.frame_size)  # noqa: E731
            make = _omni_inputs if ours.family.name == "qwen2_5omni" else _qwen2vl_inputs
            inputs = make(ours, processor or tok, text, items, patches)
        with torch.inference_mode():
            gen = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        ids = gen[0, inputs["input_ids"].shape[1]:].tolist()
        out[case] = {
            "text": text, "media": media, "ids": ids, "expected": tok.decode(ids, skip_special_tokens=True),
            "num_input_tokens": inputs["input_ids"].shape[1],
        }
    return out


def _qwen3_times(frames: int, fps: float) -> list[float]:
    """Each temporal patch's time by transformers' own Qwen3-VL rule (its processor's, which uses nothing of the
    processor itself)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return Qwen3VLProcessor._calculate_timestamps(None, list(range(frames)), fps, 2)


def _omni_inputs(ours, tok, text: str, items: list, video_patches) -> dict:  # (tok: the tokenizer)
    """Qwen2.5-Omni's thinker inputs as its processor makes them (its processor needs torchvision for video): images
    by the image processor, clips patched as Qwen2-VL's with their seconds per patch, audio by the feature extractor
    padded to its window with the clip's mask; each placeholder's token expanded to its item's count."""
    import io

    import soundfile
    from PIL import Image

    merge = ours.image_processor.merge_size
    kw: dict = {}
    images = [Image.open(io.BytesIO(raw)).convert("RGB") for kind, raw in items if kind == "image"]
    videos = [decoded_frames(raw) for kind, raw in items if kind == "video"]
    waves = [soundfile.read(io.BytesIO(raw), dtype="float32")[0] for kind, raw in items if kind == "audio"]
    counts: dict = {"IMAGE": [], "VIDEO": [], "AUDIO": []}
    if images:
        px = ours.image_processor(images=images, return_tensors="pt")
        kw.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
        counts["IMAGE"] = [t * h * w // merge**2 for t, h, w in px["image_grid_thw"].tolist()]
    if videos:
        patched = [video_patches(ours, frames) for frames in videos]
        kw["pixel_values_videos"] = torch.from_numpy(np.concatenate([p for p, _ in patched]))
        kw["video_grid_thw"] = torch.tensor([g for _, g in patched])
        kw["video_second_per_grid"] = torch.tensor([ours.image_processor.temporal_patch_size / 2.0] * len(videos))
        counts["VIDEO"] = [t * h * w // merge**2 for _, (t, h, w) in patched]
    if waves:
        fe = ours.feature_extractor
        out = fe(waves, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
        kw.update(input_features=out["input_features"], feature_attention_mask=out["attention_mask"])
        counts["AUDIO"] = [((int(n) - 1) // 2 + 1 - 2) // 2 + 1 for n in out["attention_mask"].sum(-1)]
    for name, found in counts.items():
        for n in found:
            text = text.replace(f"<|{name}|>", "@@" * n, 1)
        text = text.replace("@@", f"<|{name}|>")
    ids = torch.tensor([tok(text)["input_ids"]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kw}


def _qwen2vl_inputs(ours, processor, text: str, items: list, video_patches) -> dict:
    from PIL import Image
    import io

    merge = ours.image_processor.merge_size
    kw: dict = {}
    images = [Image.open(io.BytesIO(raw)).convert("RGB") for kind, raw in items if kind == "image"]
    videos = [decoded_frames(raw) for kind, raw in items if kind == "video"]
    counts = {"image": [], "video": []}
    if images:
        px = ours.image_processor(images=images, return_tensors="pt")
        kw.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
        counts["image"] = [t * h * w // merge**2 for t, h, w in px["image_grid_thw"].tolist()]
    if videos:
        patched = [video_patches(ours, frames) for frames in videos]
        times = [_qwen3_times(len(frames), 2.0) for frames in videos]  # (the clips are sampled at 2 frames a second)
        kw["pixel_values_videos"] = torch.from_numpy(np.concatenate([p for p, _ in patched]))
        kw["video_grid_thw"] = torch.tensor([g for _, g in patched])
        counts["video"] = [t * h * w // merge**2 for _, (t, h, w) in patched]
        if ours.family.name == "qwen2_5vl":  # the clips are sampled at their own rate: 2 frames a second
            kw["second_per_grid_ts"] = torch.tensor([ours.image_processor.temporal_patch_size / 2.0] * len(videos))
    for kind, pad in (("image", "<|image_pad|>"), ("video", "<|video_pad|>")):
        for i, n in enumerate(counts[kind]):
            one = f"<|vision_start|>{'@@' * n}<|vision_end|>"
            if kind == "video" and ours.family.name == "qwen3vl":  # each temporal patch after its time, as Qwen3-VL's processor writes
                t = patched[i][1][0]
                runs = "".join(f"<{when:.1f} seconds><|vision_start|>{'@@' * (n // t)}<|vision_end|>" for when in times[i])
                one = f"<|vision_start|>{runs}<|vision_end|>"  # (the clip's token replaced: the placeholder's own ends stay)
            text = text.replace(f"<|vision_start|>{pad}<|vision_end|>", one, 1)
        text = text.replace("@@", pad)
    ids = torch.tensor([processor.tokenizer(text)["input_ids"]])
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == ours.token_ids["image"]] = 1
    types[ids == ours.token_ids["video"]] = 2
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types, **kw}


def internvl_inputs(path: str, tokenizer, text: str, images: list) -> dict:
    """InternVL's inputs as its processor makes them (which needs torchvision for its video processor): the image
    processor's tiles, each image's ``<IMG_CONTEXT>`` written as ``<img>``, its tiles' tokens and ``</img>``."""
    from transformers import AutoConfig, AutoImageProcessor

    per_tile = AutoConfig.from_pretrained(path).image_seq_length
    kw = {}
    if images:
        px = AutoImageProcessor.from_pretrained(path)(images=images, crop_to_patches=True, return_tensors="pt")
        kw["pixel_values"] = px["pixel_values"]
        for n in px["num_patches"]:
            text = text.replace("<IMG_CONTEXT>", "<img>" + "@@" * (per_tile * int(n)) + "</img>", 1)
        text = text.replace("@@", "<IMG_CONTEXT>")
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kw}
