"""Tool calls as plain data: what tools and tool_choice force, bad tool input named by field, and
reading calls back out of text (forced JSON, or the Hermes format of a chat template)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshserve.contracts.structured import StructuredOutputError
from meshserve.structured.tools import (ToolCall, forced_calls, parse_hermes, plan_tools,
                                        template_tool_format)

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
