"""Text side of a request, shared by every stage: tokenization, image placeholders, sampling, detokenization.

The encode stage preprocesses images (:meth:`Processor.pixel_inputs`); the prefill stage turns the prompt
into token ids with each image placeholder expanded to that image's embedding count
(:meth:`Processor.prompt_ids`); the decode stage turns token ids back into text and watches for stop
strings (:class:`TextStream`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidRequest


class SamplingParams(BaseModel):
    """The ``sampling_parameters`` JSON of the entry interface (vLLM's names and defaults)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_json(cls, text: str | bytes | None) -> "SamplingParams":
        """Parse the JSON string; any problem is an :class:`InvalidRequest` naming it."""
        if text is None or (isinstance(text, (str, bytes)) and not text.strip()):
            return cls()
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"sampling_parameters is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise InvalidRequest(f"invalid sampling_parameters: {problems}") from None


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Next token from one row of logits.

    Seeded sampling draws from a generator seeded with ``(seed, step)``, so the same request gives the same
    tokens whether its steps run in one process or two, alone or in a batch.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) & 0xFFFF_FFFF_FFFF)
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass(frozen=True)
class ArchInfo:
    """What differs between the supported model families on the text side."""

    name: str  # "llava" | "qwen2vl"
    placeholder: str  # what a prompt carries once per image
    image_token: str  # the token the placeholder's image part expands into


ARCHS = {
    "llava": ArchInfo("llava", "<image>", "<image>"),
    "qwen2vl": ArchInfo("qwen2vl", "<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>"),
}


def arch_of(config: Any) -> ArchInfo:
    """The family of a transformers config (``model_type``)."""
    model_type = getattr(config, "model_type", None)
    for key, name in (("llava", "llava"), ("qwen2_vl", "qwen2vl")):
        if model_type == key:
            return ARCHS[name]
    raise ValueError(f"unsupported model type {model_type!r}; supported: llava, qwen2_vl")


class Processor:
    """Tokenizer + image processor of a checkpoint folder."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.path = Path(model_path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.arch = arch_of(self.config)
        # Loaded apart rather than through AutoProcessor: Qwen2-VL's processor needs a video processor,
        # which needs torchvision, which has no CPU build on PyPI.
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.image_processor = AutoImageProcessor.from_pretrained(self.path)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.arch.image_token)
        self.eos_token_ids = _eos_ids(self.config, self.tokenizer)
        text_config = getattr(self.config, "text_config", self.config)
        self.max_model_len: int = text_config.max_position_embeddings

    # -- images (encode stage) --------------------------------------------------------------------
    def pixel_inputs(self, images: list) -> dict[str, torch.Tensor]:
        """Model inputs for PIL images: ``pixel_values`` (and ``image_grid_thw`` for Qwen2-VL)."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}

    def image_layout(self, images: list) -> tuple[list[int], list[list[int]] | None]:
        """Embedding count of each image, and Qwen2-VL's (t, h, w) patch grids (None for LLaVA), without
        running the vision tower."""
        out = self.image_processor(images=images, return_tensors="pt")
        if "image_grid_thw" in out:
            grids = out["image_grid_thw"].tolist()
            merge = self.image_processor.merge_size
            return [t * h * w // (merge * merge) for t, h, w in grids], grids
        vision = self.config.vision_config
        height, width = out["pixel_values"].shape[-2:]
        per_image = (height // vision.patch_size) * (width // vision.patch_size)
        if getattr(self.config, "vision_feature_select_strategy", "default") == "full":
            per_image += 1  # the CLS token is kept
        return [per_image] * len(images), None

    # -- prompt (prefill stage) -------------------------------------------------------------------
    def count_placeholders(self, text: str) -> int:
        return text.count(self.arch.placeholder)

    def check_placeholders(self, text: str, num_images: int) -> None:
        """The prompt must carry the image placeholder exactly once per image."""
        found = self.count_placeholders(text)
        if found != num_images:
            raise InvalidRequest(
                f"the prompt has {found} image placeholder(s) {self.arch.placeholder!r} "
                f"but the request carries {num_images} image(s)"
            )

    def prompt_ids(self, text: str, image_token_counts: list[int]) -> list[int]:
        """Token ids of ``text`` with image ``i``'s placeholder expanded to ``image_token_counts[i]`` tokens.

        The prompt must carry the placeholder exactly once per image, and fit the context window.
        """
        self.check_placeholders(text, len(image_token_counts))
        stray = text.replace(self.arch.placeholder, "").count(self.arch.image_token)
        if stray:
            raise InvalidRequest(f"the prompt has {self.arch.image_token!r} outside an image placeholder")
        ids: list[int] = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        expanded: list[int] = []
        images = iter(image_token_counts)
        for tok in ids:
            if tok == self.image_token_id:
                expanded.extend([tok] * next(images))
            else:
                expanded.append(tok)
        return expanded

    def check_length(self, num_prompt_tokens: int) -> None:
        """The prompt must leave room for at least one generated token."""
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt is {num_prompt_tokens} tokens long (images expanded) but the model's context "
                f"window is {self.max_model_len} tokens"
            )

    # -- output (decode stage) --------------------------------------------------------------------
    def text_stream(self, params: SamplingParams) -> "TextStream":
        return TextStream(self.tokenizer, params.stop)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _eos_ids(config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(config, "text_config", None), config, getattr(config, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class TextStream:
    """Turns generated token ids into text deltas and finds stop strings.

    Text that could be the start of a stop string, or an incomplete UTF-8 character, is held back until
    it is known not to be.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned
        self.stopped = False

    @property
    def text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add a token; return the new text that is safe to emit (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        text = self.text
        for s in self._stop:
            at = text.find(s, max(0, self._emitted - len(s)))
            if at != -1:
                self.stopped = True
                return self._take(text[:at])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return ""
        hold = max((k for s in self._stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._take(text[: len(text) - hold])

    def flush(self) -> str:
        """The rest of the text once generation has ended."""
        return "" if self.stopped else self._take(self.text)

    def _take(self, upto: str) -> str:
        if len(upto) <= self._emitted:
            return ""
        delta = upto[self._emitted :]
        self._emitted = len(upto)
        return delta
