"""Tool calls on the chat API: what a tool_choice holds the answer to, and the hermes-style calls found in a model's
text, streamed or whole (trident.frontend.tools)."""

from __future__ import annotations

import json

import pytest

from trident.errors import InvalidRequest
from trident.frontend.tools import ToolChoice, ToolStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ANSWER = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def _streamed(choice: ToolChoice, text: str, step: int) -> tuple[str, list]:
    stream = ToolStream(choice)
    out = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = stream.end()
    return out + rest, calls


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_finds_hermes_calls_whole_or_streamed(step):
    choice = ToolChoice([WEATHER, TIME], None)
    assert choice.kind == "auto" and choice.structured() is None
    content, calls = choice.calls(ANSWER)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    text, streamed = _streamed(choice, ANSWER, step)
    assert text == "Let me look. " and [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    plain = "It is <b>sunny</b>, no call < here"  # text that only looks like the start of a call goes out whole
    assert choice.calls(plain) == (plain, []) and _streamed(choice, plain, step) == (plain, [])
    broken = "<tool_call>{not json}</tool_call>"
    assert choice.calls(broken) == (broken, [])


def test_named_and_required_hold_the_answer_to_the_tools_schemas():
    named = ToolChoice([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.structured() == {"json": WEATHER["function"]["parameters"], "disable_any_whitespace": True} and named.forced
    content, (call,) = named.calls('{"city": "Oslo"}')
    assert content is None and (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert _streamed(named, '{"city": "Oslo"}', 2)[0] == ""  # nothing but the call goes out
    required = ToolChoice([WEATHER, TIME], "required")
    schema = required.structured()["json"]
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    _, calls = required.calls('[{"name": "get_time", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
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
