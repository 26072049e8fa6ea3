"""OpenAI response bodies: a whole completion, its streamed chunks (SSE), usage, errors."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..errors import TridentError
from .engine import Chunk

_ERROR_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable", 504: "timeout"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def error_headers(error: TridentError) -> dict[str, str]:
    """``Retry-After`` for errors a retry may fix."""
    return {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else {}


def usage(chunk: Chunk | None) -> dict | None:
    if chunk is None:
        return None
    p, g = chunk.num_input_tokens or 0, chunk.num_output_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


@dataclass
class Completion:
    """One response's identity and shape: ``chat`` (chat.completion) or ``completions`` (text_completion).
    ``top_logprobs``: the alternatives per token a request that asked for logprobs wants (None: no logprobs)."""

    endpoint: str
    model: str
    include_usage: bool = False
    top_logprobs: int | None = None
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # characters of the completion text before the next token (the legacy API's text_offset)

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + uuid.uuid4().hex

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str | None, last: Chunk | None, logprobs: list[dict] | None = None,
              tool_calls: list | None = None, finish_reason: str | None = None) -> dict:
        """The non-streaming response (``logprobs``: every token's entry, when asked for; ``tool_calls``: the calls
        found in it, :mod:`.tools`, and then its ``finish_reason``)."""
        choice: dict = {"index": 0, "finish_reason": finish_reason or (last.finish_reason if last else None)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = [call.as_openai() for call in tool_calls]
        else:
            choice["text"] = text
        if self.top_logprobs is not None:
            choice["logprobs"] = self._logprobs(logprobs or [])
        return self._body("chat.completion" if self.chat else "text_completion", [choice], usage=usage(last))

    def sse(self, chunk: Chunk, first: bool) -> str:
        """One streamed chunk as a server-sent event."""
        if self.chat:
            delta = {"content": chunk.text, **({"role": "assistant"} if first else {})}
            choice = {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason}
        else:
            choice = {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason}
        if self.top_logprobs is not None:
            choice["logprobs"] = self._logprobs(chunk.logprobs or [])
        extra = {"usage": None} if self.include_usage else {}
        return _event(self._body("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra))

    def _logprobs(self, entries: list[dict]) -> dict:
        """OpenAI's ``logprobs`` of a choice from the entry models' entries (``{token id: {"logprob", "rank",
        "decoded_token"}}``, the sampled token's first): chat's ``content`` list, or the legacy API's four lists."""
        top = self.top_logprobs or 0
        sampled = [next(iter(e.values())) for e in entries]
        tops = [sorted((c for c in e.values() if c["rank"] <= top), key=lambda c: c["rank"]) for e in entries]
        if self.chat:
            return {"content": [{**_token(s), "top_logprobs": [_token(c) for c in t]} for s, t in zip(sampled, tops)]}
        offsets = []
        for s in sampled:
            offsets.append(self._offset)
            self._offset += len(s["decoded_token"])
        return {"tokens": [s["decoded_token"] for s in sampled], "token_logprobs": [s["logprob"] for s in sampled],
                "top_logprobs": [{c["decoded_token"]: c["logprob"] for c in [s, *t]} for s, t in zip(sampled, tops)],
                "text_offset": offsets}

    def sse_tool_calls(self, calls: list, first: bool) -> str:
        """The calls of a streamed answer, whole, in one delta."""
        delta = {"tool_calls": [call.as_openai(i) for i, call in enumerate(calls)],
                 **({"role": "assistant"} if first else {})}
        extra = {"usage": None} if self.include_usage else {}
        return _event(self._body("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": None}], **extra))

    def sse_usage(self, last: Chunk | None) -> str:
        return _event(self._body("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(last)))

    @staticmethod
    def sse_error(error: TridentError) -> str:
        return _event(error_body(error.message, error.http_status))


def _token(candidate: dict) -> dict:
    text = candidate["decoded_token"]
    return {"token": text, "logprob": candidate["logprob"], "bytes": list(text.encode("utf-8"))}


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
