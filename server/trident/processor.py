"""Input side of a request, shared by every stage: sampling parameters, tokenization, image placeholders.

The encode stage preprocesses images (:meth:`Processor.pixel_inputs`); the prefill stage turns the prompt
into token ids with each image placeholder expanded to that image's embedding count
(:meth:`Processor.prompt_ids`). The output side (detokenizing, stop strings, responses) is
:mod:`trident.output`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engines.families import Family, family_of
from .errors import InvalidRequest


GREEDY_BELOW = 1e-5


VLLM_SAMPLING_NAMES = frozenset({
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
    "logprobs", "prompt_logprobs", "stop_token_ids", "bad_words", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "detokenize",
    "logit_bias", "allowed_token_ids", "output_kind", "guided_decoding", "structured_outputs", "extra_args",
})
"""vLLM ``SamplingParams`` names that Trident's engines do not use: accepted (clients of Triton's vLLM backend
send them), ignored."""


class SamplingParams(BaseModel):
    """The ``sampling_parameters`` JSON of the entry interface (vLLM's names and defaults)."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_names(cls, data: Any) -> Any:
        """A name neither here nor in vLLM's ``SamplingParams`` is a mistake (a typo would otherwise change
        nothing, silently); vLLM's other names are accepted and, for now, ignored."""
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields) - VLLM_SAMPLING_NAMES)
            if unknown:
                raise ValueError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as in vLLM): dividing logits by them overflows."""
        return self.temperature < GREEDY_BELOW

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
            problems = "; ".join(
                ": ".join(filter(None, (".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, "))))
                for err in e.errors()
            )
            raise InvalidRequest(f"invalid sampling_parameters: {problems}") from None


class Processor:
    """Tokenizer + image processor of a checkpoint folder."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.path = Path(model_path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.family: Family = family_of(self.config)
        # Loaded apart rather than through AutoProcessor: Qwen2-VL's processor needs a video processor,
        # which needs torchvision, which has no CPU build on PyPI.
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.image_processor = AutoImageProcessor.from_pretrained(self.path)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.family.image_token)
        self.eos_token_ids = _eos_ids(self.config, self.tokenizer)
        text_config = getattr(self.config, "text_config", self.config)
        self.max_model_len: int = text_config.max_position_embeddings

    # -- images (encode stage) --------------------------------------------------------------------
    def pixel_inputs(self, images: list) -> dict:
        """Model inputs for PIL images: ``pixel_values`` (and ``image_grid_thw`` for Qwen2-VL)."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}

    def image_layout(self, images: list) -> tuple[list[int], list[list[int]] | None]:
        """Embedding count of each image, and Qwen2-VL's (t, h, w) patch grids (None for LLaVA), without
        running the vision tower."""
        return self.family.image_layout(self.config, self.image_processor, images)

    # -- prompt (prefill stage) -------------------------------------------------------------------
    def count_placeholders(self, text: str) -> int:
        return text.count(self.family.placeholder)

    def check_placeholders(self, text: str, num_images: int) -> None:
        """The prompt must carry the image placeholder exactly once per image."""
        found = self.count_placeholders(text)
        if found != num_images:
            raise InvalidRequest(
                f"the prompt has {found} image placeholder(s) {self.family.placeholder!r} "
                f"but the request carries {num_images} image(s)"
            )

    def prompt_ids(self, text: str, image_token_counts: list[int]) -> list[int]:
        """Token ids of ``text`` with image ``i``'s placeholder expanded to ``image_token_counts[i]`` tokens.

        The prompt must carry the placeholder exactly once per image, and fit the context window.
        """
        self.check_placeholders(text, len(image_token_counts))
        stray = text.replace(self.family.placeholder, "").count(self.family.image_token)
        if stray:
            raise InvalidRequest(f"the prompt has {self.family.image_token!r} outside an image placeholder")
        ids: list[int] = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        self.check_length(len(ids) - len(image_token_counts) + sum(image_token_counts))  # before expanding
        expanded: list[int] = []
        images = iter(image_token_counts)
        for tok in ids:
            if tok == self.image_token_id:
                expanded.extend([tok] * next(images))
            else:
                expanded.append(tok)
        return expanded

    def check_length(self, num_prompt_tokens: int) -> None:
        """The prompt must have a token and leave room for at least one generated token."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty (it has no tokens)")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt is {num_prompt_tokens} tokens long (images expanded) but the model's context "
                f"window is {self.max_model_len} tokens"
            )

    # -- output ---------------------------------------------------------------------------------------
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
