"""What an engine offers the stage workers, and what passes between its parts.

A stage worker talks to one :class:`StageEngine`: the stage-level operations (encode images, prefill a
prompt, generate a stream of tokens) with the records that cross Triton (``embedding_meta``, ``kv_meta``)
as bytes. The ``hf`` engine builds them from three roles (:class:`Encoder`, :class:`Prefiller`,
:class:`Decoder`) joined by :mod:`trident.engines.handoff`; the ``vllm`` engine from vLLM engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from ..output import DecodeEvent, Generation
from ..processor import SamplingParams

__all__ = [
    "DecodeEvent", "DecodeRequest", "Decoder", "Encoded", "Encoder", "Generation", "ImageEmbeddings", "PrefillResult",
    "Prefiller", "StageEngine",
]


@dataclass
class ImageEmbeddings:
    """Projected image features of one request, all images back to back: ``(sum(token_counts), hidden)``."""

    embeddings: torch.Tensor
    token_counts: list[int]
    grid_thw: list[list[int]] | None = None  # Qwen2-VL: (t, h, w) patches per image, for its 3-D positions


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


class Encoder(Protocol):
    def encode(self, images: list) -> ImageEmbeddings:
        """PIL images -> their embeddings."""
        ...


class Prefiller(Protocol):
    def prefill(
        self, prompt_ids: list[int], images: ImageEmbeddings | None, params: SamplingParams, seed: int
    ) -> PrefillResult:
        """Prompt token ids (placeholders expanded) + image embeddings -> KV cache + first token."""
        ...


class Decoder(Protocol):
    def submit(self, request: DecodeRequest, loop=None) -> "Iterator[DecodeEvent]":
        """Start decoding; iterate the returned stream (``async for`` when given an asyncio loop) for events
        until one has a ``finish_reason``."""
        ...


class StageEngine(Protocol):
    """The stage-level operations a worker calls; one object per worker, whatever stage it binds.

    Records come and go as bytes (``None`` when there is nothing to pass on, e.g. no images). Bad input
    raises :class:`~trident.errors.InvalidRequest`.

    ``calls_at_once``: how many requests of a one-answer stage (encode, prefill, encode_prefill) the engine
    wants at once. Triton hands such a stage model's instance one request at a time, so the worker binds
    that many instances (streaming stages take any number through one).
    """

    calls_at_once: int

    async def encode(self, images: list) -> Encoded:
        """A request's images (:class:`~trident.media.ImageItem`) -> ``embedding_meta`` (the embeddings stay
        with this worker until read)."""
        ...

    async def prefill(
        self, text: str, params: SamplingParams, *, images: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        """A prompt with raw ``images`` or the embeddings of ``embedding_meta`` -> ``kv_meta``."""
        ...

    async def generate(
        self, text: str | None, params: SamplingParams, *, images: list = (),
        embedding_meta: bytes | None = None, kv_meta: bytes | None = None,
    ) -> Generation:
        """Start generating from raw ``images``, from ``embedding_meta`` or from a prefill's ``kv_meta``."""
        ...

    def discard(self, record: bytes) -> None:
        """A record this stage was given but will not read (the request failed first): free it now."""
        ...

    def stats(self) -> dict:
        """Counters for operators and tests (pool regions, active requests, KV cache usage)."""
        ...

    def close(self) -> None: ...
