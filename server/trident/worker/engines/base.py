"""What an engine offers the stage workers, and what passes between its parts.

A stage worker talks to one :class:`StageEngine`: the stage-level operations (encode media, prefill a
prompt, generate a stream of tokens) with the records that cross Triton (``embedding_meta``, ``kv_meta``)
as bytes. The ``hf`` engine builds them from three roles (:class:`Encoder`, :class:`Prefiller`,
:class:`Decoder`) joined by :mod:`trident.worker.engines.handoff`; the ``vllm`` engine from vLLM engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch

from trident.core.output import DecodeEvent, Generation, RequestOutput, TokenLogprob
from trident.core.processor import SamplingParams

if TYPE_CHECKING:
    from trident.core.structured import Constraint
    from trident.worker.engines.kv_claims import KVClaims
    from trident.core.transfer import Region

__all__ = [
    "DecodeEvent", "DecodeRequest", "Decoder", "Encoded", "Encoder", "Generation", "MediaEmbeddings", "PrefillResult",
    "Prefiller", "StageEngine",
]


@dataclass
class MediaEmbeddings:
    """Projected features of a request's media, all items back to back: ``(sum(token_counts), hidden)``.

    Items are held by kind in :data:`~trident.core.media.MODALITIES` order (images, then video clips, then audio
    clips), each kind in the order of its placeholders in the prompt."""

    embeddings: torch.Tensor
    token_counts: list[int]
    grid_thw: list[list[int]] | None = None  # Qwen2-VL: (t, h, w) patches per item, for its 3-D positions ([]: none)
    kinds: list[str] | None = None  # each item's modality (None: all images)
    seconds: list[float] | None = None  # Qwen2.5-VL, Qwen3-VL: a clip's seconds per temporal patch (0 for other items)
    frames: list[int] | None = None  # Qwen3-VL: a clip's sampled frames (0 for other items), which place its patches in time

    @property
    def item_kinds(self) -> list[str]:
        return list(self.kinds) if self.kinds is not None else ["image"] * len(self.token_counts)

    def by_kind(self) -> dict[str, tuple[list[torch.Tensor], list[list[int]] | None]]:
        """Each kind's per-item rows and grids, in the order of the items."""
        rows = torch.split(self.embeddings, self.token_counts)
        out: dict[str, tuple[list, list | None]] = {}
        for i, kind in enumerate(self.item_kinds):
            items, grids = out.setdefault(kind, ([], [] if self.grid_thw is not None else None))
            items.append(rows[i])
            if grids is not None:
                grids.append(self.grid_thw[i])
        return out



@dataclass
class Encoded:
    """What the encode stage hands on: the ``embedding_meta`` record and a report for the scheduler's
    metrics (this request's cache hits, misses and shared encodes; the cache's bytes and evictions)."""

    record: bytes
    report: dict


@dataclass
class PrefillResult:
    """The prompt's KV cache and the first generated token."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each (1, kv_heads, prompt_len, head_dim)
    first_token: int
    prompt_len: int
    rope_delta: int = 0  # Qwen2-VL: decode position = cache length + rope_delta
    seed: int = 0  # sampling seed the decode side continues with
    kv_region: Region | None = None  # the send-pool region ``kv`` was computed into, back to back (handed on as it is)
    first_logprobs: list[TokenLogprob] | None = None  # the first token's logprob entry (when the request asks)
    constraint: Constraint | None = None  # the request's structured output, past the first token (when it asks)
    forks: list[Fork] = field(default_factory=list)  # ``n`` > 1: choices 1 .. n-1, sampled from the same logits


@dataclass(frozen=True)
class Fork:
    """A further choice of a prefill (``n`` > 1): its first token, sampled from the same logits with seed + its
    index, that token's logprob entry and its structured output's state; the KV cache is the prefill's, shared."""

    first_token: int
    first_logprobs: list[TokenLogprob] | None = None
    constraint: Constraint | None = None


@dataclass
class DecodeRequest:
    """What the decode role needs to continue a prefilled request."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    first_token: int
    prompt_len: int
    params: SamplingParams
    rope_delta: int = 0
    seed: int = 0
    request_id: str = ""
    on_admit: Callable[[], None] | None = None  # called once ``kv`` has been copied and may be freed
    # the request's output with the first token already pushed and sent (the engine emits it before the KV is
    # read, so that it does not wait behind a READ and a decode step); None: the decoder emits it on admission
    output: RequestOutput | None = None
    first_logprobs: list[TokenLogprob] | None = None  # the first token's logprob entry, for the decoder to emit
    constraint: Constraint | None = None  # its structured output, past the first token (trident.core.structured)


class Encoder(Protocol):
    def encode(self, items: list[tuple[str, object]]) -> MediaEmbeddings:
        """Decoded items ``(kind, item)`` -> their embeddings, in the same order."""
        ...


class Prefiller(Protocol):
    def prefill(
        self, prompt_ids: list[int], media: MediaEmbeddings | None, params: SamplingParams, seed: int
    ) -> PrefillResult:
        """Prompt token ids (placeholders expanded) + media embeddings -> KV cache + first token."""
        ...


class Decoder(Protocol):
    def submit(self, request: DecodeRequest, loop=None) -> "Iterator[DecodeEvent]":
        """Start decoding; iterate the returned stream (``async for`` when given an asyncio loop) for events
        until one has a ``finish_reason``."""
        ...


class StageEngine(Protocol):
    """The stage-level operations a worker calls; one object per worker, whatever stage it binds.

    Records come and go as bytes (``None`` when there is nothing to pass on, e.g. no images). Bad input
    raises :class:`~trident.core.errors.InvalidRequest`.

    ``calls_at_once``: how many requests of a one-answer stage (encode, prefill, encode_prefill) the engine
    wants at once. Triton hands such a stage model's instance one request at a time, so the worker binds
    that many instances (streaming stages take any number through one).
    """

    calls_at_once: int
    kv_claims: KVClaims | None  # a vLLM KV producer's claims on its KV (its consumers take them); None elsewhere

    async def encode(self, media: list, private: bool = False) -> Encoded:
        """A request's media (:class:`~trident.core.media.MediaItem`) -> ``embedding_meta`` (the embeddings stay
        with this worker until read); ``private``: encoded for this request alone (no cache hit, nothing kept)."""
        ...

    async def prefill(
        self, text: str, params: SamplingParams, *, media: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        """A prompt with raw ``media`` (undecoded :class:`~trident.core.media.MediaItem`) or the embeddings of
        ``embedding_meta`` -> ``kv_meta``."""
        ...

    async def generate(
        self, text: str | None, params: SamplingParams, *, media: list = (),
        embedding_meta: bytes | None = None, kv_meta: bytes | None = None,
    ) -> Generation:
        """Start generating from raw ``media``, from ``embedding_meta`` or from a prefill's ``kv_meta``."""
        ...

    def discard(self, record: bytes) -> None:
        """A record this stage was given but will not read (the request failed first): free it now."""
        ...

    def stats(self) -> dict:
        """Counters for operators and tests (pool regions, active requests, KV cache usage)."""
        ...

    def close(self) -> None: ...
