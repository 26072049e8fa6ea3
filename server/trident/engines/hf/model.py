"""The hf engine's model roles: a checkpoint loaded with transformers (CPU, fp32), its encoder and prefiller.

It is the correctness oracle: encode -> prefill -> decode here reproduces ``model.generate()`` token for
token under greedy sampling. :class:`HFEncoder` and :class:`HFPrefiller` run one request at a time;
family differences (vision call, multimodal inputs, positions) come from the family adapter.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ... import tracing
from ...errors import InvalidRequest, MalformedRecord
from ...heap import keep_freed_memory
from ...processor import Processor, SamplingParams
from ...protocol import HFKVRecord, TensorSpec
from ...structured import Grammars
from ...transfer.tensors import dtype_name
from ..base import MediaEmbeddings, PrefillResult
from .sampling import candidates, sample


DTYPE = torch.float32  # what the hf engine computes in, and so the dtype of every KV cache it hands on


def load_model(model_path: str | Path, processor: Processor | None = None):
    """A checkpoint's transformers model in fp32 with SDPA attention, in eval mode."""
    family = (processor or Processor(model_path)).family
    return family.load_model(model_path, DTYPE).eval()


class HFModel:
    """A loaded checkpoint: processor + model, shared by the roles one worker serves."""

    dtype = DTYPE

    def __init__(self, model_path: str | Path) -> None:
        keep_freed_memory()  # every request makes and drops tensors of some MiB (see :mod:`trident.heap`)
        self.processor = Processor(model_path)
        self.family = self.processor.family
        self.model = load_model(model_path, self.processor)
        text = self.model.config.text_config
        self.num_layers: int = text.num_hidden_layers
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.vocab_size: int = self.model.get_output_embeddings().out_features
        self.lock = threading.Lock()  # prefill mutates model state (Qwen's rope_deltas)
        self.grammars = Grammars(self.processor.tokenizer, self.vocab_size, sorted(self.processor.eos_token_ids))

    def kv_spec(self, prompt_len: int) -> TensorSpec:
        """A prompt's KV cache as it is handed on: ``2 * num_layers`` tensors (keys, values of each layer)."""
        return TensorSpec(dtype_name(self.dtype), (1, self.kv_heads, prompt_len, self.head_dim), 2 * self.num_layers)

    def check_kv(self, record: HFKVRecord) -> None:
        """A ``kv_meta`` must describe this model's KV cache of its prompt and a continuation it can run:
        refused before anything is read or allocated, so that one bad record fails only its own request."""
        max_len = self.processor.max_model_len
        if record.prompt_len >= max_len:
            raise MalformedRecord(f"kv record prompt_len {record.prompt_len} is not below the context window {max_len}")
        want = self.kv_spec(record.prompt_len)
        if record.transfer.tensors != (want,):
            got = ", ".join(f"{s.count} x {s.dtype}{list(s.shape)}" for s in record.transfer.tensors)
            raise MalformedRecord(
                f"kv record holds {got}; this model's KV cache of {record.prompt_len} tokens is "
                f"{want.count} x {want.dtype}{list(want.shape)}"
            )
        if not 0 <= record.first_token < self.vocab_size:
            raise MalformedRecord(f"kv record first_token {record.first_token} is outside the vocabulary ({self.vocab_size})")
        if not 0 <= record.prompt_len + record.rope_delta <= max_len:
            raise MalformedRecord(f"kv record rope_delta {record.rope_delta} puts positions outside 0..{max_len}")


class HFEncoder:
    """Decoded media -> projected embeddings: each kind's items of a request in one encoder batch."""

    def __init__(self, model: HFModel) -> None:
        self.m = model

    @torch.inference_mode()
    def encode(self, items: list) -> MediaEmbeddings:
        """``(kind, decoded item)`` pairs (a bare PIL image is an image) -> their embeddings, in order."""
        items = [item if isinstance(item, tuple) else ("image", item) for item in items]
        if not items:
            raise InvalidRequest("encode needs at least one image, video or audio clip")
        rows: list = [None] * len(items)
        grids: list = [None] * len(items)
        seconds: list[float] = [0.0] * len(items)
        for kind in dict.fromkeys(kind for kind, _ in items):
            where = [i for i, (k, _) in enumerate(items) if k == kind]
            with tracing.step(f"{kind}_preprocess"):
                inputs = self.m.processor.media_inputs(kind, [items[i][1] for i in where])
            with tracing.step("vision_tower" if kind == "image" else f"{kind}_encoder"):
                features, grid = self.m.family.encode(self.m.model, kind, inputs)
            for j, i in enumerate(where):
                rows[i], grids[i] = features[j], (grid[j] if grid is not None else None)
                if "second_per_grid_ts" in inputs:
                    seconds[i] = float(inputs["second_per_grid_ts"][j])
        has_grids = any(g is not None for g in grids)
        return MediaEmbeddings(
            torch.cat(rows), [r.shape[0] for r in rows], [list(g) for g in grids] if has_grids else None,
            [kind for kind, _ in items], seconds if any(seconds) else None,
        )


class HFPrefiller:
    """Prompt ids + media embeddings -> the prompt's KV cache and the first sampled token."""

    def __init__(self, model: HFModel) -> None:
        self.m = model
        # whether transformers' cache for this model is plain full-attention layers, which can be computed in place
        layers = DynamicCache(config=model.model.config).layers
        self._full_attention = len(layers) == model.num_layers and all(type(x) is DynamicLayer for x in layers)

    @torch.inference_mode()
    def prefill(
        self, prompt_ids: list[int], media: MediaEmbeddings | None, params: SamplingParams, seed: int,
        kv_into: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> PrefillResult:
        """``kv_into``: per layer, the (k, v) tensors the prompt's KV cache is to be computed into (a region of
        the send pool, :meth:`HFModel.kv_spec`); the result's ``kv`` is them when the model wrote there (check with
        ``is``), else tensors of its own."""
        self.m.processor.check_length(len(prompt_ids))
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        kwargs: dict = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}
        family, token_ids = self.m.family, self.m.processor.token_ids
        if media is not None and media.token_counts:
            for kind, (rows, _) in media.by_kind().items():
                expected = int((ids == token_ids[kind]).sum()) if kind in token_ids else 0
                if expected != sum(r.shape[0] for r in rows):
                    raise InvalidRequest(
                        f"the prompt has {expected} {kind} tokens but the embeddings cover {sum(r.shape[0] for r in rows)}"
                    )
        if kv_into is not None and self._full_attention and len(kv_into) == self.m.num_layers:
            kwargs["past_key_values"] = _cache_into(kv_into)
        with self.m.lock, tracing.step("prefill"):
            family.reset(self.m.model)
            if media is not None and media.token_counts:
                kwargs.update(family.prefill_inputs(self.m.model, ids, media, token_ids))
            out = self.m.model(**kwargs, logits_to_keep=1)
        rope_delta = family.rope_delta(out)
        cache = out.past_key_values
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        logits, constraint = out.logits[0, -1], None
        if params.structured_outputs is not None:  # the first token keeps to the request's structure too
            constraint = self.m.grammars.constraint(params.structured_outputs)
            logits = constraint.mask(logits)
        first = sample(logits, params, seed, step=0)
        if constraint is not None:
            constraint.accept(first)
        logprobs = candidates(logits, first, params.logprobs) if params.logprobs is not None else None
        return PrefillResult(kv=kv, first_token=first, prompt_len=len(prompt_ids), rope_delta=rope_delta, seed=seed,
                             first_logprobs=logprobs, constraint=constraint)


class _IntoLayer(DynamicLayer):
    """A cache layer whose prefill writes its keys and values into given tensors (where transformers' own
    layer concatenates them into new ones: the same one copy, into memory the stage then hands on as it is);
    later updates grow it as usual."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self._into: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        into, self._into = self._into, None
        if self.is_initialized or into is None or into[0].shape != key_states.shape or into[1].shape != value_states.shape:
            return super().update(key_states, value_states, *args, **kwargs)
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = into[0].copy_(key_states), into[1].copy_(value_states)
        return self.keys, self.values


def _cache_into(kv_into: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """The cache transformers builds for a model of full-attention layers, with those layers writing into
    ``kv_into``."""
    cache = DynamicCache()
    cache.layers = [_IntoLayer(k, v) for k, v in kv_into]
    return cache
