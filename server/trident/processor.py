"""Input side of a request, shared by every stage: sampling parameters, tokenization, media placeholders.

The encode stage preprocesses media (:meth:`Processor.media_inputs`); the prefill stage turns the prompt
into token ids with each placeholder expanded to that item's embedding count (:meth:`Processor.prompt_ids`). The output side (detokenizing, stop strings, responses) is
:mod:`trident.output`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .families import Family, family_of
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
    """Tokenizer + media processors (image processor, audio feature extractor) of a checkpoint folder."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.path = Path(model_path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.family: Family = family_of(self.config)
        # Loaded apart rather than through AutoProcessor: Qwen2-VL's processor needs a video processor,
        # which needs torchvision, which has no CPU build on PyPI.
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.modalities = self.family.modalities
        self.image_processor = None
        self.feature_extractor = None
        if "image" in self.modalities or "video" in self.modalities:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(self.path)
        if "audio" in self.modalities:
            from transformers import AutoFeatureExtractor

            self.feature_extractor = AutoFeatureExtractor.from_pretrained(self.path)
        self.token_ids = {
            kind: self.tokenizer.convert_tokens_to_ids(p.token) for kind, p in self.family.placeholders.items()
        }
        self.image_token_id = self.token_ids.get("image")
        self.eos_token_ids = _eos_ids(self.config, self.tokenizer)
        text_config = getattr(self.config, "text_config", self.config)
        self.max_model_len: int = text_config.max_position_embeddings

    @property
    def audio_rate(self) -> int:
        """The rate audio clips are resampled to: ``media_limits.audio_sample_rate``, else the feature extractor's."""
        from .media import LIMITS

        return LIMITS.audio_sample_rate or getattr(self.feature_extractor, "sampling_rate", None) or 16000

    # -- media (encode stage) ---------------------------------------------------------------------
    def open(self, item):
        """A :class:`~trident.media.MediaItem` decoded (the family must take its kind)."""
        self.check_kinds({item.kind: 1})
        return item.open(self.audio_rate)

    def media_inputs(self, kind: str, items: list) -> dict:
        """Model inputs of decoded items of one kind (``pixel_values``, ``pixel_values_videos``,
        ``input_features``, with their grids or masks)."""
        return self.family.media_inputs(self, kind, items)

    def layout(self, kind: str, items: list) -> tuple[list[int], list[list[int]] | None]:
        """Embedding count of each decoded item of one kind, and Qwen2-VL's (t, h, w) patch grids (None for
        the others), without running the encoder."""
        return self.family.layout(self, kind, items)

    # -- prompt (prefill stage) -------------------------------------------------------------------
    def check_kinds(self, counts: dict[str, int]) -> None:
        """Every kind of media the request carries must be one the model takes."""
        for kind, n in counts.items():
            if n and kind not in self.family.placeholders:
                takes = ", ".join(self.modalities)
                raise InvalidRequest(
                    f"the request carries {kind} but this model ({self.family.name}) takes {takes} only"
                )

    def check_placeholders(self, text: str, counts: dict[str, int] | int) -> None:
        """The prompt must carry each kind's placeholder exactly once per item of that kind (an int: images)."""
        counts = {"image": counts} if isinstance(counts, int) else counts
        self.check_kinds(counts)
        for kind, placeholder in self.family.placeholders.items():
            found, items = text.count(placeholder.text), counts.get(kind, 0)
            if found != items:
                noun = {"image": "image", "video": "video", "audio": "audio clip"}[kind]
                raise InvalidRequest(
                    f"the prompt has {found} {kind} placeholder(s) {placeholder.text!r} "
                    f"but the request carries {items} {noun}(s)"
                )

    def prompt_ids(self, text: str, token_counts: list[int], kinds: list[str] | None = None) -> list[int]:
        """Token ids of ``text`` with the placeholder of item ``i`` (of kind ``kinds[i]``, images when None)
        expanded to ``token_counts[i]`` tokens.

        The prompt must carry each kind's placeholder exactly once per item, and fit the context window.
        """
        kinds = list(kinds) if kinds is not None else ["image"] * len(token_counts)
        per_kind: dict[str, list[int]] = {}
        for kind, count in zip(kinds, token_counts, strict=True):
            per_kind.setdefault(kind, []).append(count)
        self.check_placeholders(text, {k: len(v) for k, v in per_kind.items()})
        for kind, placeholder in self.family.placeholders.items():
            if text.replace(placeholder.text, "").count(placeholder.token):
                raise InvalidRequest(f"the prompt has {placeholder.token!r} outside a {kind} placeholder")
        ids: list[int] = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        self.check_length(len(ids) - len(token_counts) + sum(token_counts))  # before expanding
        expanding = {self.token_ids[kind]: iter(counts) for kind, counts in per_kind.items()}
        expanded: list[int] = []
        for tok in ids:
            if tok in expanding:
                expanded.extend([tok] * next(expanding[tok]))
            else:
                expanded.append(tok)
        return expanded

    def check_length(self, num_prompt_tokens: int) -> None:
        """The prompt must have a token and leave room for at least one generated token."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty (it has no tokens)")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt is {num_prompt_tokens} tokens long (media expanded) but the model's context "
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
