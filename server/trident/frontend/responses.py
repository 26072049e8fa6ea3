"""OpenAI response bodies: a whole completion, its streamed chunks (SSE), usage, errors."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from trident.core.errors import TridentError

@dataclass
class Chunk:
    """One streamed piece of a choice (``index``) of a generation; its last one has ``finish_reason``.
    ``num_output_tokens``: the choice's tokens generated so far; ``logprobs``: the entries of this piece's tokens, when the request asked for them (each
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the sampled token's first)."""

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    logprobs: list[dict] | None = None
    index: int = 0  # its choice (``n`` > 1)


_ERROR_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable", 504: "timeout"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def error_headers(error: TridentError) -> dict[str, str]:
    """``Retry-After`` for errors a retry may fix."""
    return {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else {}


def usage(lasts: list[Chunk | None]) -> dict | None:
    """The usage of the generations (a request's choices) whose last chunks are ``lasts``: the prompt once, the
    completions' tokens together."""
    ended = [c for c in lasts if c is not None]
    if not ended:
        return None
    p, g = ended[0].num_input_tokens or 0, sum(c.num_output_tokens or 0 for c in ended)
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
    # per choice, the characters of its text before its next token (the legacy API's text_offset)
    _offsets: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + uuid.uuid4().hex

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def choice(self, index: int, text: str | None, last: Chunk | None, logprobs: list[dict] | None = None,
               tool_calls: list | None = None, finish_reason: str | None = None) -> dict:
        """One choice of the non-streaming response (``logprobs``: every token's entry, when asked for;
        ``tool_calls``: the calls found in it, :mod:`.tools`, and then its ``finish_reason``)."""
        choice: dict = {"index": index, "finish_reason": finish_reason or (last.finish_reason if last else None)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = [call.as_openai() for call in tool_calls]
        else:
            choice["text"] = text
        if self.top_logprobs is not None:
            choice["logprobs"] = self._logprobs(logprobs or [], index)
        return choice

    def whole(self, choices: list[dict], lasts: list[Chunk | None]) -> dict:
        """The non-streaming response: its ``choices``, and the usage of the generations that ended in ``lasts``."""
        return self._body("chat.completion" if self.chat else "text_completion", choices, usage=usage(lasts))

    def sse(self, chunk: Chunk, first: bool, index: int = 0) -> str:
        """One streamed chunk of choice ``index`` as a server-sent event."""
        if self.chat:
            delta = {"content": chunk.text, **({"role": "assistant"} if first else {})}
            choice = {"index": index, "delta": delta, "finish_reason": chunk.finish_reason}
        else:
            choice = {"index": index, "text": chunk.text, "finish_reason": chunk.finish_reason}
        if self.top_logprobs is not None:
            choice["logprobs"] = self._logprobs(chunk.logprobs or [], index)
        extra = {"usage": None} if self.include_usage else {}
        return _event(self._body("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra))

    def _logprobs(self, entries: list[dict], index: int = 0) -> dict:
        """OpenAI's ``logprobs`` of a choice from the entry models' entries (``{token id: {"logprob", "rank",
        "decoded_token"}}``, the sampled token's first): chat's ``content`` list, or the legacy API's four lists."""
        top = self.top_logprobs or 0
        sampled = [next(iter(e.values())) for e in entries]
        tops = [sorted((c for c in e.values() if c["rank"] <= top), key=lambda c: c["rank"]) for e in entries]
        if self.chat:
            return {"content": [{**_token(s), "top_logprobs": [_token(c) for c in t]} for s, t in zip(sampled, tops)]}
        offsets, offset = [], self._offsets.get(index, 0)
        for s in sampled:
            offsets.append(offset)
            offset += len(s["decoded_token"])
        self._offsets[index] = offset
        return {"tokens": [s["decoded_token"] for s in sampled], "token_logprobs": [s["logprob"] for s in sampled],
                "top_logprobs": [{c["decoded_token"]: c["logprob"] for c in [s, *t]} for s, t in zip(sampled, tops)],
                "text_offset": offsets}

    def sse_tool_calls(self, deltas: list[dict], first: bool, index: int = 0) -> str:
        """Tool-call deltas (:class:`~trident.frontend.tools.ToolStream`) of streamed choice ``index``."""
        delta = {"tool_calls": deltas, **({"role": "assistant"} if first else {})}
        extra = {"usage": None} if self.include_usage else {}
        return _event(self._body("chat.completion.chunk", [{"index": index, "delta": delta, "finish_reason": None}],
                                 **extra))

    def sse_usage(self, lasts: list[Chunk | None]) -> str:
        return _event(self._body("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(lasts)))

    @staticmethod
    def sse_error(error: TridentError) -> str:
        return _event(error_body(error.message, error.http_status))


def _token(candidate: dict) -> dict:
    text = candidate["decoded_token"]
    return {"token": text, "logprob": candidate["logprob"], "bytes": list(text.encode("utf-8"))}


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
