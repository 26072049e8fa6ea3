"""Tool calls on the chat API: what a tool_choice holds the answer to, and the hermes-style calls found in a model's
text, streamed or whole (trident.frontend.tools)."""

from __future__ import annotations

import json

import pytest

from trident.core.errors import InvalidRequest
from trident.frontend.tools import ToolChoice, ToolStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ANSWER = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def _streamed(choice: ToolChoice, text: str, step: int) -> tuple[str, list]:
    """The text a stream sends and its calls, from the deltas (accumulated per index as a client does)."""
    text_out, deltas, pieces = _fed(choice, text, step)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", ""])
        call[0] += d["function"].get("name", "")
        call[1] += d["function"]["arguments"]
    return text_out, [(name, args) for _, (name, args) in sorted(calls.items())]


def _fed(choice: ToolChoice, text: str, step: int) -> tuple[str, list[dict], list[int]]:
    """(text sent, every delta, how many deltas each piece brought, the end's last)."""
    stream = ToolStream(choice)
    out, deltas, pieces = "", [], []
    for i in range(0, len(text), step):
        sent, new = stream.feed(text[i:i + step])
        out, deltas = out + sent, deltas + new
        pieces.append(len(new))
    rest, _, more = stream.end()
    pieces.append(len(more))
    return out + rest, deltas + more, pieces


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_finds_hermes_calls_whole_or_streamed(step):
    choice = ToolChoice([WEATHER, TIME], None)
    assert choice.kind == "auto" and choice.structured() is None
    content, calls = choice.calls(ANSWER)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    text, streamed = _streamed(choice, ANSWER, step)
    assert text == "Let me look. " and streamed == [(c.name, c.arguments) for c in calls]
    # each call goes out whole as soon as its block closes: the first before the second's text has come
    _, deltas, pieces = _fed(choice, ANSWER, step)
    first_closed = ANSWER.index("</tool_call>") + len("</tool_call>")
    assert sum(pieces[:-(-first_closed // step)]) >= 1 and sum(pieces) == 2 and pieces[-1] == 0
    assert [d["index"] for d in deltas] == [0, 1] and all(d["id"].startswith("chatcmpl-tool-") for d in deltas)
    plain = "It is <b>sunny</b>, no call < here"  # text that only looks like the start of a call goes out whole
    assert choice.calls(plain) == (plain, []) and _streamed(choice, plain, step) == (plain, [])
    broken = "<tool_call>{not json}</tool_call>"
    assert choice.calls(broken) == (broken, [])


def test_named_and_required_hold_the_answer_to_the_tools_schemas():
    named = ToolChoice([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.structured() == {"json": WEATHER["function"]["parameters"], "disable_any_whitespace": True} and named.forced
    content, (call,) = named.calls('{"city": "Oslo"}')
    assert content is None and (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    # nothing but the call goes out: its arguments token by token, the first delta with the call's id and name
    assert _streamed(named, '{"city": "Oslo"}', 2) == ("", [("get_weather", '{"city": "Oslo"}')])
    _, deltas, pieces = _fed(named, '{"city": "Oslo"}', 2)
    assert pieces == [1] * 8 + [0] and deltas[0]["id"] and "id" not in deltas[1]
    required = ToolChoice([WEATHER, TIME], "required")
    schema = required.structured()["json"]
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    _, calls = required.calls('[{"name": "get_time", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert _streamed(required, '[{"name": "get_time", "parameters": {}}]', 3) == ("", [("get_time", "{}")])
    cut = '[{"name": "get_time", "parameters": {}},{"na'  # cut off: the list so far, as text
    assert _streamed(required, cut, 3) == (cut, [])
    assert required.finish_reason("stop", calls) == "tool_calls" and named.finish_reason("stop", [call]) == "stop"
    assert ToolChoice([WEATHER], "none").calls(ANSWER) == (ANSWER, [])


@pytest.mark.parametrize("tools, choice, message", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not one of the tools"),
    (None, "required", "tool_choice required needs tools"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "a name of 1 to 64 letters"),
    ([WEATHER], "sometimes", "tool_choice must be none, auto, required"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "parameters must be a JSON schema"),
])
def test_bad_tools_are_refused_naming_the_problem(tools, choice, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
        ToolChoice(tools, choice)
