"""The three roles an engine plays, and what passes between them.

A stage worker holds one engine object per role it serves; the records between roles are plain
dataclasses of tensors and ints, which the workers move between processes with :mod:`trident.transfer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from ..processor import SamplingParams


@dataclass
class ImageEmbeddings:
    """Projected image features of one request, all images back to back: ``(sum(token_counts), hidden)``."""

    embeddings: torch.Tensor
    token_counts: list[int]
    grid_thw: list[list[int]] | None = None  # Qwen2-VL: (t, h, w) patches per image, for its 3-D positions


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


@dataclass
class DecodeEvent:
    """One step's output of a request: new token ids and text; ``finish_reason`` set on the last event."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length" | "abort"
    num_output_tokens: int = 0
    extra: dict = field(default_factory=dict)


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
