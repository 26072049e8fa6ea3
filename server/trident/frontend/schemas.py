"""OpenAI request and response bodies (the subset Trident serves)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trident.core.errors import InvalidRequest
from trident.core.processor import UNSUPPORTED_DEFAULTS
from trident.core.protocol import MAX_CHOICES, MAX_LOGPROBS
from trident.frontend.tools import MAX_TOOLS, ToolChoice

"""The most choices (``n``) one request may ask for."""

NOT_YET: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"), "echo": (None, False), "suffix": (None, ""),
}
"""OpenAI request fields Trident does not do yet, with the values that ask for nothing: any other value is refused
(400, naming the field), never ignored."""
FORWARDED = set(UNSUPPORTED_DEFAULTS) | {"top_k"}  # (structured_outputs: see _Sampling.structured)
"""vLLM's sampling names a request may carry besides OpenAI's (vLLM's server takes them in the body): passed on in
``sampling_parameters``, where the entry models honour or refuse each one."""


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class MediaURL(BaseModel):
    url: str


class InputAudio(BaseModel):
    """OpenAI's own audio part: base64 bytes and their format."""

    data: str
    format: str


class ContentPart(BaseModel):
    """A message part: text, ``image_url``, ``video_url`` (vLLM's extension), ``input_audio`` (OpenAI's) or
    ``audio_url`` (vLLM's)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "image_url", "video_url", "input_audio", "audio_url"]
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: MediaURL | None = None
    audio_url: MediaURL | None = None
    input_audio: InputAudio | None = None


MAX_MESSAGES = 4096  # per chat request
MAX_PARTS = 4096  # content parts per message, and per request (all its messages' together)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    # (the bound is on the parts: a text's length is the context window's to bound, at the scheduler)
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchema(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older structured-output fields and the ``structured_outputs`` key each stands for."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, all from one prefill (sampling_parameters.n)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension, sent by load generators
    response_format: ResponseFormat | None = None

    def not_yet(self) -> list[str]:
        """The fields of :data:`NOT_YET` this request asks something of."""
        extra = self.model_extra or {}
        return sorted(name for name, nothing in NOT_YET.items()
                      if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in nothing))

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The entry models' ``sampling_parameters``."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens or default_max_tokens, "ignore_eos": self.ignore_eos}
        if self.n > 1:
            out["n"] = self.n
        out.update({k: v for k, v in (self.model_extra or {}).items() if k in FORWARDED})
        for name in ("temperature", "top_p", "seed"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        structured = self.structured()
        if structured:
            out["structured_outputs"] = structured
        return out

    def structured(self) -> dict[str, Any]:
        """What ``response_format``, vLLM's ``guided_*`` fields and its ``structured_outputs`` ask of the text, as
        ``sampling_parameters.structured_outputs`` (trident.core.structured; more than one is refused there)."""
        extra = self.model_extra or {}
        out = dict(extra.get("structured_outputs") or {})
        out.update({key: extra[name] for name, key in GUIDED.items() if extra.get(name) is not None})
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out["json_object"] = True
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequest("response_format json_schema needs json_schema.schema")
            out["json"] = rf.json_schema.schema_
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)

    @model_validator(mode="before")
    @classmethod
    def _parts_in_all(cls, data: Any) -> Any:
        """At most :data:`MAX_PARTS` content parts in all its messages, counted in the JSON before any is built (a
        request of 4096 messages of 4096 parts each would have 16 million made on the event loop)."""
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            parts = sum(len(m["content"]) for m in data["messages"]
                        if isinstance(m, dict) and isinstance(m.get("content"), list))
            if parts > MAX_PARTS:
                raise ValueError(f"the messages have {parts} content parts in all; at most {MAX_PARTS}")
        return data

    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None

    def tool_choice_of(self) -> ToolChoice:
        """What its ``tools`` and ``tool_choice`` ask (a 400 names what is wrong)."""
        return ToolChoice(self.tools, self.tool_choice)

    def structured(self) -> dict[str, Any]:
        out = super().structured()
        forced = self.tool_choice_of().structured()
        if forced and out:
            raise InvalidRequest(f"tool_choice {self.tool_choice!r} holds the answer to the tool's arguments: leave "
                                 "out response_format and the guided fields")
        return forced or out

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        out = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        return out


class CompletionRequest(_Sampling):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the top logprobs per token (the legacy API's)

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        out = super().sampling(default_max_tokens)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out
