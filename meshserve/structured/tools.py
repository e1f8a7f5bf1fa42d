"""Tool calls: the constraint that forces them, and reading them back out of generated text.

- ``tool_choice="required"`` or a named function: the output is held by a JSON schema built from
  the tools' parameter schemas (after vLLM): a named function's output *is* its arguments object;
  ``required`` generates a non-empty array of ``{"name": ..., "parameters": {...}}``, one item per
  call, each item's parameters held to that tool's schema.
- ``tool_choice="auto"``: nothing is forced; the model may call tools in its own format, which its
  chat template defines. The one format read here is Hermes' ``<tool_call>{json}</tool_call>``
  (Qwen2.5, Hermes, SmolLM3 and most open chat templates since); a template that mentions no tool
  call format (the bundled SmolLM2's) gets plain content back.

Plain text in, plain data out: the HTTP edge wraps these in OpenAI's response shapes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshserve.contracts.structured import StructuredOutputError, StructuredOutputParams
from meshserve.structured.grammar import build_grammar

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE)
                          + r"|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI sends the arguments as a string)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools shape its output."""

    constraint: StructuredOutputParams | None  # forced calls: the schema that holds the output
    mode: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function a named tool_choice forces


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool = True) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` (OpenAI's shapes) and say what they force;
    ``parallel_tool_calls=False`` holds ``required`` to a single call.

    Raises ``StructuredOutputError`` naming the field: a tool without a name, a parameter schema
    that is not valid, or a ``tool_choice`` that names no tool."""
    tools = list(tools or ())
    schemas = {name: params for name, params in _checked_tools(tools)}
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("none", "auto"):
        return ToolPlan(None, tool_choice)
    if tool_choice == "required":
        if not tools:
            raise StructuredOutputError("tool_choice", '"required" needs at least one tool')
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(_compact(schema), "required")
    name = _named_choice(tool_choice)
    if name not in schemas:
        known = ", ".join(schemas) or "none"
        raise StructuredOutputError("tool_choice", f"names no tool: {name!r} (tools: {known})")
    return ToolPlan(_compact(schemas[name]), "named", name)


def _compact(schema: dict) -> StructuredOutputParams:
    # Arguments are read by programs, not people: whitespace between their tokens only costs
    # tokens (and lets a sampled model pad a call until max_tokens).
    return StructuredOutputParams(json=schema, disable_any_whitespace=True)


def _checked_tools(tools: list[Mapping[str, Any]]) -> list[tuple[str, dict]]:
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
                or not function["name"]:
            raise StructuredOutputError(f"tools[{i}].function.name", "must be a non-empty string")
        schema = function.get("parameters") or {"type": "object"}
        field = f"tools[{i}].function.parameters"
        try:
            build_grammar(StructuredOutputParams(json=schema))
        except StructuredOutputError as exc:
            raise StructuredOutputError(field, exc.message) from None
        checked.append((function["name"], dict(schema)))
    return checked


def _named_choice(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise StructuredOutputError(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}')
    return function["name"]


def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls in the output of a request whose plan forced them (``required`` or named)."""
    if plan.mode == "named":
        return [ToolCall(plan.named, text.strip())]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short (max_tokens) before the array closed
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in items]


def template_tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template defines: "hermes", or None when it defines none."""
    if chat_template and HERMES_OPEN in chat_template:
        return "hermes"
    return None


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Split a Hermes-format reply into its content (text outside the calls) and its calls.

    A call whose body is not a JSON object with a ``name`` stays in the content: the model wrote
    text that looks like a call, and the user should see it rather than lose it.
    """
    calls: list[ToolCall] = []
    content: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        content.append(text[last:match.start()])
        last = match.end()
        calls.append(ToolCall(body["name"], json.dumps(body.get("arguments", {}),
                                                       ensure_ascii=False)))
    content.append(text[last:])
    return "".join(content).strip(), calls


def call_dicts(calls: Sequence[ToolCall], ids: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls``."""
    return [{"id": call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call, call_id in zip(calls, ids)]


class ToolCallStream:
    """A reply's text deltas as OpenAI streams a tool-calling reply: ``(content, tool_calls)``
    per delta, ``tool_calls`` being the chunk's ``delta.tool_calls`` entries.

    A named call streams its arguments as they are generated (the first entry carries the id,
    type and name). ``required`` and Hermes calls are parsed from the whole reply, so each call
    goes out complete in the last chunk; Hermes content before a call streams as it comes, held
    back only while it might be the start of ``<tool_call>``.
    """

    def __init__(self, plan: ToolPlan, hermes: bool, new_id) -> None:
        self.plan, self.hermes, self._new_id = plan, hermes, new_id
        self._text = ""
        self._sent = 0  # characters of _text already sent as content (Hermes)
        self._named_started = False
        self.calls: list[ToolCall] = []  # every call, once the reply is complete

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        self._text += delta
        if self.plan.mode == "named":
            return "", self._named(delta, finished)
        if self.plan.mode == "required":
            if not finished:
                return "", []
            self.calls = forced_calls(self.plan, self._text)
            return "", self._whole(self.calls)
        if not self.hermes:
            return delta, []
        return self._hermes(finished)

    def _named(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        if finished:
            self.calls = forced_calls(self.plan, self._text)
        if not delta and self._named_started:
            return []
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
        if not self._named_started:
            self._named_started = True
            entry = {"index": 0, "id": self._new_id(), "type": "function",
                     "function": {"name": self.plan.named, "arguments": delta}}
        return [entry]

    def _hermes(self, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if finished:
            content, self.calls = parse_hermes(self._text)
            if not self.calls:
                rest, self._sent = self._text[self._sent:], len(self._text)
                return rest, []
            # The content sent so far is its start (all of it before the first call).
            return content[len(self._text[:self._sent].strip()):], self._whole(self.calls)
        start = self._text.find(HERMES_OPEN)
        if start < 0:
            start = _partial_tag_start(self._text)
        safe = len(self._text) if start < 0 else start
        out, self._sent = self._text[self._sent:safe], max(self._sent, safe)
        return out, []

    def _whole(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        return [{"index": i, **entry}
                for i, entry in enumerate(call_dicts(calls, [self._new_id() for _ in calls]))]


def _partial_tag_start(text: str) -> int:
    """Where a trailing prefix of ``<tool_call>`` starts in ``text``, or -1."""
    for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-size:]):
            return len(text) - size
    return -1
