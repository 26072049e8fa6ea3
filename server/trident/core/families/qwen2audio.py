"""Qwen2-Audio: a Whisper-style audio encoder + projector in front of a Qwen2 text model. Each clip is a
log-mel spectrogram padded to the encoder's 30 s window; ``<|AUDIO|>`` expands to one token per two encoder
frames of the clip's own length. Positions are 1-D."""

from __future__ import annotations

from trident.core.families import Family, Placeholder


class Qwen2Audio(Family):
    name = "qwen2audio"
    model_type = "qwen2_audio"
    model_class = "Qwen2AudioForConditionalGeneration"
    placeholders = {"audio": Placeholder("<|audio_bos|><|AUDIO|><|audio_eos|>", "<|AUDIO|>")}

    def media_inputs(self, processor, kind, items):
        from trident.core.errors import InvalidRequest

        fe = processor.feature_extractor
        for wave in items:  # the encoder's window: the feature extractor would cut a longer clip silently
            if len(wave) > fe.n_samples:
                raise InvalidRequest(
                    f"an audio clip is {len(wave) / fe.sampling_rate:.1f} s long; this model hears at most "
                    f"{fe.chunk_length} s per clip"
                )
        out = fe(items, sampling_rate=fe.sampling_rate, return_attention_mask=True, padding="max_length",
                 return_tensors="pt")
        return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}

    def encode(self, model, kind, inputs):
        """The audio tower over each clip's own frames (masked as ``Qwen2AudioModel.forward`` masks them),
        then the projector; each clip keeps its first ``output_length`` rows."""
        import torch
        from transformers.masking_utils import create_bidirectional_mask

        features, mask = inputs["input_features"], inputs["feature_attention_mask"]
        tower = model.model.audio_tower
        feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
        frames = (features.shape[-1] - 2) // 2 + 1
        keep = (torch.arange(frames, device=features.device)[None, :] < feat_lengths[:, None]).long()
        attn = create_bidirectional_mask(
            config=tower.config, inputs_embeds=torch.zeros(len(features), frames, 1, dtype=features.dtype,
                                                                  device=features.device),
            attention_mask=keep,
        )
        hidden = tower(features, attention_mask=attn).last_hidden_state
        projected = model.model.multi_modal_projector(hidden)
        return [projected[i, : int(n)] for i, n in enumerate(out_lengths)], None

    def prefill_inputs(self, model, input_ids, media, token_ids):
        """The prompt's embeddings with the audio rows in place of the ``<|AUDIO|>`` tokens (Qwen2-Audio's
        forward has no precomputed-features input)."""
        import torch

        embeds = model.get_input_embeddings()(input_ids)
        rows = torch.cat(media.by_kind()["audio"][0]) if media.token_counts else None
        if rows is not None:
            mask = (input_ids == token_ids["audio"]).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, rows.to(embeds.dtype))
        return {"input_ids": None, "inputs_embeds": embeds}


    def vllm_inputs(self, processor, kind, items):
        return [(wave, processor.audio_rate) for wave in items]

FAMILY = Qwen2Audio()
