"""Input side of a request, shared by every stage: sampling parameters, tokenization, media placeholders.

The encode stage preprocesses media (:meth:`Processor.media_inputs`); the prefill stage turns the prompt
into token ids with each placeholder expanded to that item's embedding count (:meth:`Processor.prompt_ids`). The output side (detokenizing, stop strings, responses) is
:mod:`trident.core.output`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trident.core.families import Family, family_of
from trident.core.errors import InvalidRequest
from trident.core.protocol import MAX_CHOICES, MAX_LOGPROBS, MAX_SAMPLING_JSON
from trident.core.structured import StructuredOutput


GREEDY_BELOW = 1e-5


SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a signed 64-bit seed, as vLLM's server takes
INT32_MAX = (1 << 31) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "min_tokens": 0, "prompt_logprobs": None, "stop_token_ids": None,
    "bad_words": None, "include_stop_str_in_output": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "detokenize": True, "logit_bias": None,
    "allowed_token_ids": None, "output_kind": None, "guided_decoding": None,
    "extra_args": None,
}
"""vLLM ``SamplingParams`` names that Trident's engines do not honour, with vLLM's defaults: a request may send one
at its default (or null, or empty), as clients of Triton's vLLM backend do; any other value is refused (400, naming
it), never ignored."""


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` asks for no more than vLLM's ``default`` does (null and empty do not ask)."""
    if value is None or value == [] or value == {}:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return value == default


class SamplingParams(BaseModel):
    """The ``sampling_parameters`` JSON of the entry interface (vLLM's names, defaults and ranges)."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)  # 0 or -1: off
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: list[str] = Field([], max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    # top logprobs per generated token, besides the sampled token's (None: none, not even its own)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each sampled with seed + its index (vLLM's rule)
    structured_outputs: StructuredOutput | None = None  # (trident.core.structured)

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _nothing_asked(cls, v: Any) -> Any:
        return None if v is None or v == {} or v == "" else v

    @model_validator(mode="before")
    @classmethod
    def _known_names(cls, data: Any) -> Any:
        """A name neither here nor in vLLM's ``SamplingParams`` is a mistake (a typo would otherwise change
        nothing, silently); one of vLLM's that Trident does not honour is refused unless it asks for vLLM's
        default (:data:`UNSUPPORTED_DEFAULTS`)."""
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields) - set(UNSUPPORTED_DEFAULTS))
            if unknown:
                raise ValueError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}")
            asked = sorted(n for n in set(data) & set(UNSUPPORTED_DEFAULTS)
                           if not _is_default(data[n], UNSUPPORTED_DEFAULTS[n]))
            if asked:
                raise ValueError("not supported by Trident's engines: " + ", ".join(
                    f"{n} (send {UNSUPPORTED_DEFAULTS[n]!r} or leave it out)" for n in asked))
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, v: list[str]) -> list[str]:
        """Each stop string is looked for after every token: at most :data:`MAX_STOP_CHARS` characters each."""
        long = [i for i, s in enumerate(v) if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"stop string {long[0]} has {len(v[long[0]])} characters; at most {MAX_STOP_CHARS}")
        return v

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as in vLLM): dividing logits by them overflows."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_json(cls, text: str | bytes | None) -> "SamplingParams":
        """Parse the JSON string; any problem is an :class:`InvalidRequest` naming it."""
        if text is None or (isinstance(text, (str, bytes)) and not text.strip()):
            return cls()
        if len(text) > MAX_SAMPLING_JSON:
            raise InvalidRequest(f"sampling_parameters has {len(text)} bytes; at most {MAX_SAMPLING_JSON}")
        try:
            data = json.loads(text)
        except RecursionError:
            raise InvalidRequest("sampling_parameters is nested too deeply") from None
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError, an integer of too many digits)
            raise InvalidRequest(f"sampling_parameters is not valid JSON: {str(e)[:200]}") from None
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
        # (a model no family adapter lists: its placeholders as its chat template writes them, for the vllm engine)
        self.family: Family = family_of(self.config, self.path)
        # Loaded apart rather than through AutoProcessor: Qwen2-VL's processor needs a video processor,
        # which needs torchvision, which has no CPU build on PyPI.
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.modalities = self.family.modalities
        self.image_processor = None
        self.feature_extractor = None
        if self.family.listed and ("image" in self.modalities or "video" in self.modalities):  # (the adapters' own)
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(self.path)
        if "audio" in self.modalities:
            from transformers import AutoFeatureExtractor

            self.feature_extractor = AutoFeatureExtractor.from_pretrained(self.path)
        self.token_ids = {
            kind: self.tokenizer.convert_tokens_to_ids(p.token) for kind, p in self.family.placeholders.items() if p.token
        }
        self.image_token_id = self.token_ids.get("image")
        self.eos_token_ids = _eos_ids(self.config, self.tokenizer)
        text_config = self.config.get_text_config()  # (Qwen2.5-Omni's: its thinker's)
        self.max_model_len: int = text_config.max_position_embeddings

    @property
    def audio_rate(self) -> int:
        """The rate audio clips are resampled to: ``media_limits.audio_sample_rate``, else the feature extractor's."""
        from trident.core.media import LIMITS

        return LIMITS.audio_sample_rate or getattr(self.feature_extractor, "sampling_rate", None) or 16000

    # -- media (encode stage) ---------------------------------------------------------------------
    def open(self, items: list) -> list:
        """A request's :class:`~trident.core.media.MediaItem` s decoded, in order (the family must take their kinds),
        within the request's pixel budget (``media_limits.max_request_pixels``)."""
        from trident.core.media import PixelBudget, counts

        self.check_kinds(counts(items))
        budget = PixelBudget()
        return [item.open(self.audio_rate, budget) for item in items]

    def media_inputs(self, kind: str, items: list) -> dict:
        """Model inputs of decoded items of one kind (``pixel_values``, ``pixel_values_videos``,
        ``input_features``, with their grids or masks)."""
        return self.family.media_inputs(self, kind, items)

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

    def prompt_ids(self, text: str, token_counts: list[int], kinds: list[str] | None = None, media=None) -> list[int]:
        """Token ids of ``text`` with the placeholder of item ``i`` (of kind ``kinds[i]``, images when None)
        expanded to ``token_counts[i]`` tokens, as the family writes it (:meth:`Family.item_text`; ``media``: the
        items' grids, seconds and frames, a :class:`~trident.worker.engines.base.MediaEmbeddings` or an embeddings record).

        The prompt must carry each kind's placeholder exactly once per item, and fit the context window.
        """
        kinds = list(kinds) if kinds is not None else ["image"] * len(token_counts)
        if not self.family.listed:
            self.family.prompt_ids()  # (refused: only the engine that processes its media expands its placeholders)
        per_kind: dict[str, list[int]] = {}
        for kind, count in zip(kinds, token_counts, strict=True):
            per_kind.setdefault(kind, []).append(count)
        self.check_placeholders(text, {k: len(v) for k, v in per_kind.items()})
        for kind, placeholder in self.family.placeholders.items():
            if text.replace(placeholder.text, "").count(placeholder.token):
                raise InvalidRequest(f"the prompt has {placeholder.token!r} outside a {kind} placeholder")
        grids = getattr(media, "grid_thw", None) or [None] * len(kinds)
        seconds = getattr(media, "seconds", None) or [0.0] * len(kinds)
        frames = getattr(media, "frames", None) or [0] * len(kinds)
        runs: dict[str, list[int]] = {kind: [] for kind in per_kind}
        for kind, placeholder in self.family.placeholders.items():
            # (Gemma 3's: newlines, start and end tokens around the image's; Qwen3-VL's clips: each patch's time)
            written = [self.family.item_text(kind, n, g, s, f) for k, n, g, s, f
                       in zip(kinds, token_counts, grids, seconds, frames) if k == kind]
            parts = text.split(placeholder.text)
            text = parts[0] + "".join(item + part for (item, _), part in zip(written, parts[1:]))
            runs.setdefault(kind, []).extend(n for _, item_runs in written for n in item_runs)
        ids: list[int] = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        self.check_length(len(ids) - sum(map(len, runs.values())) + sum(token_counts))  # before expanding
        expanding = {self.token_ids[kind]: iter(counts) for kind, counts in runs.items() if counts}
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
    for source in (config.get_text_config(), config, getattr(config, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
