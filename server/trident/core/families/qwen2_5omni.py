"""Qwen2.5-Omni's thinker: Qwen2.5-VL's vision tower and timed M-RoPE for images and video, and a Whisper-style audio
encoder, in one model; an image, a clip and an audio clip may share a request (and its one encode stage). A hub
checkpoint is the whole Omni model (thinker, talker, vocoder); only the thinker is loaded: Trident serves text out.
An audio clip's tokens are placed in the prompt's positions by its feature length, which the prefill gives back from
its token count (any length that makes that count places it the same)."""

from __future__ import annotations

from trident.core.families import Placeholder
from trident.core.families.qwen2_5vl import Qwen25VL
from trident.core.families.qwen2audio import Qwen2Audio


class Qwen25Omni(Qwen25VL):
    name = "qwen2_5omni"
    model_type = "qwen2_5_omni"
    model_class = "Qwen2_5OmniThinkerForConditionalGeneration"
    placeholders = {
        "image": Placeholder("<|vision_bos|><|IMAGE|><|vision_eos|>", "<|IMAGE|>"),
        "video": Placeholder("<|vision_bos|><|VIDEO|><|vision_eos|>", "<|VIDEO|>"),
        "audio": Placeholder("<|audio_bos|><|AUDIO|><|audio_eos|>", "<|AUDIO|>"),
    }

    def load_model(self, path, dtype):
        import transformers

        thinker = transformers.AutoConfig.from_pretrained(path).thinker_config  # (the checkpoint's weights under thinker.)
        return transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
            path, config=thinker, dtype=dtype, attn_implementation="sdpa")

    def language_model(self, model):
        return model.model

    # -- media ------------------------------------------------------------------------------------------
    def frame_size(self, processor, frames):
        """The bounds Qwen2.5-Omni's processor gives its video processor (not the checkpoint's video settings)."""
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessorKwargs
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        size = Qwen2_5OmniProcessorKwargs._defaults["videos_kwargs"]["size"]
        ip = processor.image_processor
        return smart_resize(*frames[0].shape[:2], factor=ip.patch_size * ip.merge_size, min_pixels=size["shortest_edge"],
                            max_pixels=size["longest_edge"])

    def media_inputs(self, processor, kind, items):
        if kind == "audio":
            return Qwen2Audio.media_inputs(self, processor, kind, items)
        return super().media_inputs(processor, kind, items)

    def encode(self, model, kind, inputs):
        if kind != "audio":  # (transformers' get_image_features / get_video_features)
            return super().encode(model, kind, inputs)
        mask = inputs["feature_attention_mask"]
        out = model.get_audio_features(inputs["input_features"], mask, return_dict=True)  # (every clip's rows, joined)
        _, lengths = model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))
        return list(out.last_hidden_state.split(lengths.tolist())), None

    # -- prefill -----------------------------------------------------------------------------------------
    def prefill_inputs(self, model, input_ids, media, token_ids):
        import torch

        kwargs = super().prefill_inputs(model, input_ids, media, token_ids)  # (images and clips; their seconds)
        if "second_per_grid_ts" in kwargs:
            kwargs["video_second_per_grid"] = kwargs.pop("second_per_grid_ts")  # (the thinker's name for it)
        audio = kwargs["mm_encoder_outputs"].pop("audio", None)
        if audio is not None:  # (its rows in place of its tokens; the ids stay, for the positions)
            rows = audio.pooler_output
            embeds = model.get_input_embeddings()(input_ids)
            mask = (input_ids == token_ids["audio"]).unsqueeze(-1)
            kwargs["inputs_embeds"] = embeds.masked_scatter(mask, torch.cat(rows).to(embeds.dtype))
            # each clip's feature length as one that gives its token count: 4 * count - 1
            lengths = torch.tensor([4 * r.shape[0] - 1 for r in rows], device=input_ids.device)
            kwargs["feature_attention_mask"] = (torch.arange(int(lengths.max()), device=input_ids.device)[None, :]
                                                < lengths[:, None]).long()
        return kwargs

    def reset(self, model):
        model.rope_deltas = None

    def vllm_inputs(self, processor, kind, items):
        if kind == "audio":
            return Qwen2Audio.vllm_inputs(self, processor, kind, items)
        return super().vllm_inputs(processor, kind, items)


FAMILY = Qwen25Omni()
