"""Tool calls on the chat API (``tools``, ``tool_choice``), as vLLM's OpenAI server makes them.

- ``none``: the tools go to the chat template; the answer is text.
- ``auto`` (the default with tools): the answer is text, and the calls the model writes in the hermes style of
  Qwen's templates, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, become ``tool_calls``
  (finish reason ``tool_calls``).
- a named function: the answer is that function's arguments, held to its ``parameters`` schema by structured
  output (:mod:`trident.core.structured`); finish reason ``stop``, as OpenAI's.
- ``required``: a JSON list of one or more ``{"name", "parameters"}``, each held to its function's schema.

Streamed (:class:`ToolStream`), as vLLM's server streams them: text goes out as it comes until a call may begin;
a named function's arguments go out token by token (the first delta carries the call's id and name); each ``auto``
call goes out whole as soon as its ``</tool_call>`` closes it; ``required``'s list goes out at the end, once it is
whole.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from trident.core.errors import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(name, text, "chatcmpl-tool-" + uuid.uuid4().hex)


class ToolChoice:
    """What a request's ``tools`` and ``tool_choice`` ask (checked when it arrives: a 400 names what is wrong)."""

    def __init__(self, tools: list[dict] | None, choice: Any) -> None:
        self.functions: dict[str, dict] = {}
        for tool in tools or ():
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
                raise InvalidRequest("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}} with a "
                                     "name of 1 to 64 letters, digits, _ or -")
            if not isinstance(fn.get("parameters", {}), dict):
                raise InvalidRequest(f"tool {fn['name']!r}: parameters must be a JSON schema object")
            self.functions[fn["name"]] = fn
        if len(self.functions) > MAX_TOOLS:
            raise InvalidRequest(f"{len(self.functions)} tools; at most {MAX_TOOLS}")
        self.named: str | None = None
        if choice is None:
            self.kind = "auto" if self.functions else "none"
        elif choice in ("none", "auto", "required"):
            self.kind = choice
        elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
            self.kind, self.named = "named", choice["function"]["name"]
        else:
            raise InvalidRequest("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}")
        if self.kind in ("auto", "required", "named") and not self.functions:
            raise InvalidRequest(f"tool_choice {self.named or self.kind} needs tools")
        if self.named is not None and self.named not in self.functions:
            raise InvalidRequest(f"tool_choice names {self.named!r}, which is not one of the tools")

    @property
    def forced(self) -> bool:
        """The whole answer is calls (named, required): no text is streamed."""
        return self.kind in ("named", "required")

    def structured(self) -> dict | None:
        """The ``structured_outputs`` a forced choice holds the answer to."""
        if self.kind == "named":
            return {"json": self.functions[self.named].get("parameters") or {"type": "object"},
                    "disable_any_whitespace": True}
        if self.kind == "required":
            return {"disable_any_whitespace": True, "json": {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                  "parameters": fn.get("parameters") or {"type": "object"}},
                 "required": ["name", "parameters"]}
                for name, fn in self.functions.items()]}}}
        return None

    def template_tools(self) -> list[dict] | None:
        return [{"type": "function", "function": fn} for fn in self.functions.values()] or None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content (None where it is all calls) and its calls."""
        if self.kind == "named":
            return None, [_call(self.named, text)]
        if self.kind == "required":
            try:
                items = json.loads(text)
                return None, [_call(i["name"], i["parameters"]) for i in items]
            except (ValueError, TypeError, KeyError):  # cut off (max_tokens) before the list was whole
                return text, []
        if self.kind == "none" or OPEN not in text:
            return text, []
        calls = []
        for body in _CALL.findall(text):
            try:
                found = json.loads(body)
                calls.append(_call(found["name"], found.get("arguments", {})))
            except (ValueError, TypeError, KeyError):
                return text, []  # not a call after all: the text as it is
        content = _CALL.sub("", text).strip()
        return content or None, calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        return "tool_calls" if calls and self.kind in ("auto", "required") and reason == "stop" else reason


class ToolStream:
    """Streams an answer: its text while no call can have begun, and its calls as tool-call deltas (OpenAI's
    ``delta.tool_calls`` entries, each with its call's ``index``) as soon as each can go out."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._text: list[str] = []
        self._held = ""  # text not sent yet
        self._in_call = False  # a call has begun: the rest is held
        self._calls: list[ToolCall] = []  # the calls sent
        self._named = _call(choice.named, "") if choice.kind == "named" else None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The text that can go out now, and the tool-call deltas."""
        self._text.append(text)
        if self._named is not None:
            if not text:
                return "", []
            if not self._calls:
                self._calls.append(self._named)
                return "", [{"index": 0, "id": self._named.id, "type": "function",
                             "function": {"name": self._named.name, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}]
        if self.choice.kind == "required":
            return "", []
        if self.choice.kind == "none":
            return text, []
        if self._in_call:
            self._held += text
            return "", self._closed()
        held = self._held + text
        at = held.find(OPEN)
        if at != -1:
            self._in_call, self._held = True, held[at:]
            return held[:at], self._closed()
        keep = next((k for k in range(min(len(OPEN) - 1, len(held)), 0, -1) if OPEN.startswith(held[-k:])), 0)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep], []

    def _closed(self) -> list[dict]:
        """The ``auto`` calls whose blocks have closed since the last ones sent (a block that is no call stays text)."""
        deltas = []
        while (match := _CALL.search(self._held)) is not None:
            try:
                found = json.loads(match.group(1))
                call = _call(found["name"], found.get("arguments", {}))
            except (ValueError, TypeError, KeyError):
                break
            self._held = self._held[:match.start()] + self._held[match.end():]
            deltas.append(call.as_openai(len(self._calls)))
            self._calls.append(call)
        return deltas

    def end(self) -> tuple[str, list[ToolCall], list[dict]]:
        """Once the answer is whole: the text still to send, every call (sent or not), and the deltas still to send."""
        if self.choice.kind == "required":
            content, calls = self.choice.calls("".join(self._text))
            return ("" if calls else content or ""), calls, [c.as_openai(i) for i, c in enumerate(calls)]
        if self._named is not None:
            if not self._calls:  # (an empty answer: cut off at once)
                self._calls.append(self._named)
                return "", self._calls, [self._named.as_openai(0)]
            return "", self._calls, []
        if self._calls:
            return self._held.strip(), self._calls, []
        return self._held, [], []
