"""The hf engine's model roles: a checkpoint loaded with transformers (CPU, fp32), its encoder and prefiller.

It is the correctness oracle: encode -> prefill -> decode here reproduces ``model.generate()`` token for
token under greedy sampling. :class:`HFEncoder` and :class:`HFPrefiller` run one request at a time;
family differences (vision call, multimodal inputs, positions) come from the family adapter.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ... import timings
from ...errors import InvalidRequest
from ...processor import Processor, SamplingParams
from ..base import ImageEmbeddings, PrefillResult
from .sampling import sample


def load_model(model_path: str | Path, processor: Processor | None = None):
    """A checkpoint's transformers model in fp32 with SDPA attention, in eval mode."""
    family = (processor or Processor(model_path)).family
    return family.load_model(model_path, torch.float32).eval()


class HFModel:
    """A loaded checkpoint: processor + model, shared by the roles one worker serves."""

    def __init__(self, model_path: str | Path) -> None:
        self.processor = Processor(model_path)
        self.family = self.processor.family
        self.model = load_model(model_path, self.processor)
        text = self.model.config.text_config
        self.num_layers: int = text.num_hidden_layers
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.lock = threading.Lock()  # prefill mutates model state (Qwen's rope_deltas)


class HFEncoder:
    """Images -> projected embeddings, all images of a request in one vision-tower batch."""

    def __init__(self, model: HFModel) -> None:
        self.m = model

    @torch.inference_mode()
    def encode(self, images: list) -> ImageEmbeddings:
        if not images:
            raise InvalidRequest("encode needs at least one image")
        with timings.step("image_preprocess"):
            pixels = self.m.processor.pixel_inputs(images)
        with timings.step("vision_tower"):
            features, grid = self.m.family.encode_images(self.m.model, pixels)
        return ImageEmbeddings(torch.cat(features), [f.shape[0] for f in features], grid)


class HFPrefiller:
    """Prompt ids + image embeddings -> the prompt's KV cache and the first sampled token."""

    def __init__(self, model: HFModel) -> None:
        self.m = model

    @torch.inference_mode()
    def prefill(
        self, prompt_ids: list[int], images: ImageEmbeddings | None, params: SamplingParams, seed: int
    ) -> PrefillResult:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        self.m.processor.check_length(len(prompt_ids))
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        kwargs: dict = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}
        family = self.m.family
        if images is not None and images.token_counts:
            expected = int((ids == self.m.processor.image_token_id).sum())
            if expected != sum(images.token_counts):
                raise InvalidRequest(
                    f"the prompt has {expected} image tokens but the embeddings cover {sum(images.token_counts)}"
                )
            features = torch.split(images.embeddings, images.token_counts)
            kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=features)}
            kwargs.update(family.prefill_inputs(ids, self.m.processor.image_token_id, images.grid_thw))
        with self.m.lock, timings.step("prefill"):
            family.reset(self.m.model)
            out = self.m.model(**kwargs, logits_to_keep=1)
        rope_delta = family.rope_delta(out)
        cache = out.past_key_values
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        first = sample(out.logits[0, -1], params, seed, step=0)
        return PrefillResult(kv=kv, first_token=first, prompt_len=len(prompt_ids), rope_delta=rope_delta, seed=seed)
