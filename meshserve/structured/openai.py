"""The structured-output fields of an OpenAI-style request, as one ``StructuredOutputParams``.

Accepted, at most one at a time:

- OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- vLLM's extras: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, and the
  newer ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``structural_tag``, ``disable_any_whitespace``).

Errors name the request's own field (``response_format.json_schema.schema``, ``guided_regex``),
so the edge can answer 400 with it; the grammar is parsed here, before the request is routed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshserve.contracts.structured import KINDS, StructuredOutputError, StructuredOutputParams
from meshserve.structured.grammar import build_grammar

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def constraint_from_request(fields: Mapping[str, Any]) -> StructuredOutputParams | None:
    """The constraint the request's fields ask for (None: none), checked and parsed."""
    given = [name for name in ("response_format", *GUIDED, "structured_outputs")
             if fields.get(name) is not None and not _is_plain_text(name, fields[name])]
    if not given:
        return None
    if len(given) > 1:
        raise StructuredOutputError(given[1], f"cannot be combined with {given[0]}; "
                                              "give one structured-output constraint")
    name = given[0]
    value = fields[name]
    if name == "response_format":
        params, field = _response_format(value)
    elif name in GUIDED:
        params, field = _make({GUIDED[name]: value}, {f"structured_outputs.{GUIDED[name]}": name})
    else:
        if not isinstance(value, Mapping):
            raise StructuredOutputError(name, "must be an object")
        unknown = sorted(set(value) - set(KINDS) - {"disable_any_whitespace"})
        if unknown:
            raise StructuredOutputError(f"{name}.{unknown[0]}", "is not a supported option")
        params, field = _make(dict(value), {})
    try:
        build_grammar(params)
    except StructuredOutputError as exc:
        raise StructuredOutputError(field.get(exc.param, exc.param), exc.message) from None
    return params


def _is_plain_text(name: str, value: Any) -> bool:
    return name == "response_format" and isinstance(value, Mapping) and value.get("type") == "text"


def _response_format(value: Any) -> tuple[StructuredOutputParams, dict[str, str]]:
    if not isinstance(value, Mapping):
        raise StructuredOutputError("response_format", "must be an object")
    kind = value.get("type")
    if kind == "json_object":
        return _make({"json_object": True}, {})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or spec.get("schema") is None:
            raise StructuredOutputError("response_format.json_schema.schema", "is required")
        field = "response_format.json_schema.schema"
        return _make({"json": spec["schema"]}, {"structured_outputs.json": field})
    raise StructuredOutputError("response_format.type",
                                f"must be text, json_object or json_schema, got {kind!r}")


def _make(kwargs: dict[str, Any], rename: dict[str, str]
          ) -> tuple[StructuredOutputParams, dict[str, str]]:
    try:
        return StructuredOutputParams(**kwargs), rename
    except StructuredOutputError as exc:
        raise StructuredOutputError(rename.get(exc.param, exc.param), exc.message) from None
