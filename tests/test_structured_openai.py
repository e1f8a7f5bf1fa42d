"""The structured-output fields of OpenAI and vLLM requests, read into one constraint; every bad
value is refused naming the request's own field."""

from __future__ import annotations

import json

import pytest

from meshserve.contracts.structured import StructuredOutputError, StructuredOutputParams
from meshserve.structured.openai import constraint_from_request

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputParams(json=SCHEMA)),
    ({"guided_regex": "[0-9]+"}, StructuredOutputParams(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputParams(choice=("a", "b"))),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputParams(grammar='root ::= "x"')),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
     StructuredOutputParams(choice=("a",), disable_any_whitespace=True)),
    ({"response_format": {"type": "text"}, "guided_regex": "a+"},
     StructuredOutputParams(regex="a+")),
])
def test_each_form_reads_into_one_constraint(fields: dict, expected) -> None:
    got = constraint_from_request(fields)
    assert got == expected if expected is None else got.key == expected.key


@pytest.mark.parametrize("fields, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_bad_values_name_the_request_field(fields: dict, field: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        constraint_from_request(fields)
    assert info.value.param == field, info.value
