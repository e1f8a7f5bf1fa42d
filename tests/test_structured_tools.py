"""Tool calls as plain data: what tools and tool_choice force, bad tool input named by field, and
reading calls back out of text (forced JSON, or the Hermes format of a chat template)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshserve.contracts.structured import StructuredOutputError
from meshserve.structured.tools import (ToolCall, ToolCallStream, forced_calls, parse_hermes,
                                        plan_tools, template_tool_format)

ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                   "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: any object


def test_auto_and_none_force_nothing() -> None:
    assert plan_tools([ADD], None).mode == "auto"
    assert plan_tools(None, None).mode == "none"
    for choice in ("auto", "none"):
        plan = plan_tools([ADD], choice)
        assert plan.mode == choice and plan.constraint is None


def test_a_named_function_is_held_to_its_parameter_schema() -> None:
    plan = plan_tools([ADD, PING], {"type": "function", "function": {"name": "add"}})
    assert plan.mode == "named" and plan.named == "add"
    assert json.loads(plan.constraint.json) == ADD["function"]["parameters"]
    assert forced_calls(plan, ' {"a": 1, "b": 2} ') == [ToolCall("add", '{"a": 1, "b": 2}')]
    ping = plan_tools([ADD, PING], {"type": "function", "function": {"name": "ping"}})
    assert json.loads(ping.constraint.json) == {"type": "object"}


def test_required_is_a_non_empty_array_of_calls_to_known_tools() -> None:
    plan = plan_tools([ADD, PING], "required")
    schema = json.loads(plan.constraint.json)
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "add", "parameters": {"a": 1}}],
                [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert forced_calls(plan, json.dumps(good)) == [ToolCall("add", '{"a": 1, "b": 2}'),
                                                    ToolCall("ping", "{}")]
    assert forced_calls(plan, '[{"name": "add", "param') == []  # cut short by max_tokens
    single = json.loads(plan_tools([ADD], "required", parallel_tool_calls=False).constraint.json)
    assert single["maxItems"] == 1


@pytest.mark.parametrize("tools, choice, field", [
    ([ADD], {"type": "function", "function": {"name": "sub"}}, "tool_choice"),
    ([], "required", "tool_choice"),
    ([ADD], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto",
     "tools[0].function.name"),
    ([ADD, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "auto",
     "tools[1].function.parameters"),
])
def test_bad_tool_input_names_its_field(tools: list, choice, field: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        plan_tools(tools, choice)
    assert info.value.param == field


def test_the_tool_call_format_comes_from_the_chat_template() -> None:
    from tests.tiny_models import smollm2_tokenizer

    assert template_tool_format(smollm2_tokenizer().chat_template) is None  # SmolLM2: none
    assert template_tool_format("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") \
        == "hermes"


def test_hermes_calls_are_split_from_the_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert calls == [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("ping", "{}")]
    # Not a call after all: the text stays with the user.
    content, calls = parse_hermes("<tool_call>not json</tool_call> hi")
    assert calls == [] and content == "<tool_call>not json</tool_call> hi"
    # The reply ran out before the closing tag: the call is still whole.
    assert parse_hermes('<tool_call>{"name": "ping", "arguments": {}}')[1] == [
        ToolCall("ping", "{}")]


def _stream(plan, hermes: bool, pieces: list[str]):
    ids = iter(f"call_{i}" for i in range(10))
    stream = ToolCallStream(plan, hermes, lambda: next(ids))
    chunks = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return chunks, stream


def test_a_named_call_streams_its_arguments_as_openai_does() -> None:
    plan = plan_tools([ADD], {"type": "function", "function": {"name": "add"}})
    chunks, stream = _stream(plan, False, ['{"a": ', '1, "b"', ': 2}', ""])
    entries = [entry for _, calls in chunks for entry in calls]
    assert entries[0] == {"index": 0, "id": "call_0", "type": "function",
                          "function": {"name": "add", "arguments": '{"a": '}}
    assert all(set(e) == {"index", "function"} for e in entries[1:])
    assert "".join(e["function"]["arguments"] for e in entries) == '{"a": 1, "b": 2}'
    assert all(content == "" for content, _ in chunks)
    assert stream.calls == [ToolCall("add", '{"a": 1, "b": 2}')]


def test_required_calls_go_out_whole_at_the_end() -> None:
    plan = plan_tools([ADD, PING], "required")
    chunks, _ = _stream(plan, False, ['[{"name": "ping", ', '"parameters": {}}]'])
    assert chunks[0] == ("", [])
    assert chunks[1][1] == [{"index": 0, "id": "call_0", "type": "function",
                             "function": {"name": "ping", "arguments": "{}"}}]


def test_hermes_content_streams_until_a_call_begins() -> None:
    plan = plan_tools([ADD], "auto")
    chunks, stream = _stream(plan, True, ["Sure", ", adding. <tool", '_call>{"name": "add", ',
                                          '"arguments": {"a": 1, "b": 2}}</tool_call>'])
    assert "".join(c for c, _ in chunks) == "Sure, adding. "  # as generated, up to the call
    assert chunks[1][0] == ", adding. "  # "<tool" held back: it may start a call
    assert [e["function"]["name"] for e in chunks[-1][1]] == ["add"]
    plain, _ = _stream(plan, True, ["no <tools> ", "here"])
    assert "".join(c for c, _ in plain) == "no <tools> here"
    assert _stream(plan, False, ["<tool_call>x"])[0] == [("<tool_call>x", [])]
