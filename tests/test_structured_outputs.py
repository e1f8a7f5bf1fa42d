"""Structured output on the bundled SmolLM2, sampled at temperature 1.0: every constrained output
obeys its constraint, forced tool calls carry valid arguments, and the unconstrained requests of a
mixed batch produce exactly the tokens they produce alone.

Each constraint below bounds its output (string lengths, number ranges, repetition counts), so a
request that obeys it also ends within ``max_tokens``: a truncated output would fail validation
for a reason that has nothing to do with the masks.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from meshserve import LLM, SamplingParams
from meshserve.contracts.structured import StructuredOutputError, StructuredOutputParams
from meshserve.structured.compiler import GrammarCompiler
from meshserve.structured.tools import forced_calls, plan_tools

pytestmark = pytest.mark.slow  # the bundled model, sampled for a few hundred steps

N = 6  # requests per constraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "member"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
MOODS = ["positive", "negative", "neutral"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", device="cpu", num_kv_blocks=1024, max_num_seqs=16,
               max_model_len=1024)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)


def constrained(max_tokens: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputParams(**constraint))


def texts(llm: LLM, prompt: list[int], params: SamplingParams) -> list[tuple[str, str]]:
    outputs = llm.generate([prompt] * N, params)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


def test_json_schema_outputs_validate(llm: LLM) -> None:
    results = texts(llm, chat(llm, "Describe a person as JSON."), constrained(120, json=PERSON))
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in results}) > 1  # sampled, not one forced string


def test_json_object_outputs_parse_as_objects(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=7, structured_outputs=(
        StructuredOutputParams(json_object=True, disable_any_whitespace=True)))
    for output in llm.generate([chat(llm, "Reply with a JSON object.")] * 4, params):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":  # json_object bounds nothing: it may run long
            assert isinstance(json.loads(completion.text), dict)
        else:
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_regex_outputs_match(llm: LLM) -> None:
    for text, reason in texts(llm, chat(llm, "Give me a phone number."),
                              constrained(24, regex=PHONE)):
        assert reason == "stop" and re.fullmatch(PHONE, text), text


def test_choice_outputs_are_one_of_the_choices(llm: LLM) -> None:
    results = texts(llm, chat(llm, "Is 'I love it' positive, negative or neutral?"),
                    constrained(8, choice=MOODS))
    assert all(reason == "stop" and text in MOODS for text, reason in results), results


def test_ebnf_grammar_outputs_parse(llm: LLM) -> None:
    grammar = ('root ::= answer ", " reason\nanswer ::= "yes" | "no"\n'
               'reason ::= [a-z] [a-z ]{0,15} "."')
    for text, reason in texts(llm, chat(llm, "Is the sky blue? Answer and say why."),
                              constrained(32, grammar=grammar)):
        assert reason == "stop" and re.fullmatch(r"(yes|no), [a-z][a-z ]{0,15}\.", text), text


def test_a_named_tool_call_has_valid_arguments(llm: LLM) -> None:
    plan = plan_tools([WEATHER_TOOL, TIME_TOOL],
                      {"type": "function", "function": {"name": "get_weather"}})
    params = SamplingParams(temperature=1.0, max_tokens=64, structured_outputs=plan.constraint)
    schema = WEATHER_TOOL["function"]["parameters"]
    for output in llm.generate([chat(llm, "What is the weather in Paris?")] * N, params):
        calls = forced_calls(plan, output.outputs[0].text)
        assert [c.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].arguments), schema)


def test_required_tool_calls_name_a_tool_and_carry_its_arguments(llm: LLM) -> None:
    plan = plan_tools([WEATHER_TOOL, TIME_TOOL], "required", parallel_tool_calls=False)
    params = SamplingParams(temperature=1.0, max_tokens=100, structured_outputs=plan.constraint)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for output in llm.generate([chat(llm, "What time is it in Tokyo?")] * 3, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        calls = forced_calls(plan, completion.text)
        assert len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), tools[call.name])


# --- a mixed batch --------------------------------------------------------------------------

def run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Run ``requests`` together on the engine; each one's tokens and finish reason."""
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                tokens[delta.request_id].append(delta.finish_reason)
    return tokens


def free_requests(llm: LLM) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = [chat(llm, "Tell me a story."), chat(llm, "What is 2 + 2?"),
               llm.tokenizer.encode("The capital of France is")]
    return {"greedy-0": (prompts[0], SamplingParams(temperature=0.0, max_tokens=12)),
            "greedy-1": (prompts[1], SamplingParams(temperature=0.0, max_tokens=12)),
            "seeded-0": (prompts[2], SamplingParams(temperature=1.0, seed=11, max_tokens=12)),
            "seeded-1": (prompts[0], SamplingParams(temperature=0.8, top_p=0.9, seed=5,
                                                    max_tokens=12))}


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[str, list]:
    """The free requests' tokens, run by themselves."""
    return run(llm, {f"alone-{k}": v for k, v in free_requests(llm).items()})


def test_unconstrained_requests_are_unaffected_by_constrained_neighbours(llm: LLM,
                                                                         alone: dict) -> None:
    free = free_requests(llm)
    mixed_requests = {f"mixed-{k}": v for k, v in free.items()}
    prompt = chat(llm, "Describe a person as JSON.")
    for i in range(2):
        mixed_requests[f"json-{i}"] = (prompt, constrained(80, json=PERSON,
                                                           disable_any_whitespace=True))
        mixed_requests[f"regex-{i}"] = (chat(llm, "A phone number?"), constrained(24, regex=PHONE))
    mixed = run(llm, mixed_requests)
    for key in free:
        assert mixed[f"mixed-{key}"] == alone[f"alone-{key}"], key
    for i in range(2):
        *ids, reason = mixed[f"json-{i}"]
        jsonschema.validate(json.loads(llm.tokenizer.decode(ids, skip_special_tokens=True)),
                            PERSON)
        *ids, reason = mixed[f"regex-{i}"]
        assert re.fullmatch(PHONE, llm.tokenizer.decode(ids, skip_special_tokens=True))


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("constraint, field", [
    ({"regex": "[0-9"}, "structured_outputs.regex"),
    ({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
     "structured_outputs.json"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
])
def test_an_invalid_constraint_is_refused_and_queues_nothing(llm: LLM, constraint: dict,
                                                             field: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputParams(**constraint))
    with pytest.raises(StructuredOutputError) as info:
        llm.generate(["Hello", "World"], params)
    assert info.value.param == field
    assert not llm.engine.has_unfinished


def test_a_grammar_that_fails_to_compile_ends_only_its_request(
        llm: LLM, alone: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    compile_grammar = GrammarCompiler._compile

    def failing(self, grammar, kind):
        if kind == "choice":
            raise RuntimeError("simulated compiler failure")
        return compile_grammar(self, grammar, kind)

    monkeypatch.setattr(GrammarCompiler, "_compile", failing)
    free = free_requests(llm)
    requests = {f"mixed-{k}": v for k, v in free.items()}
    requests["doomed"] = (chat(llm, "Pick one."), constrained(8, choice=["never", "compiled"]))
    mixed = run(llm, requests)
    assert mixed["doomed"][-1] == "grammar" and len(mixed["doomed"]) == 2  # one stop token
    for key in free:
        assert mixed[f"mixed-{key}"] == alone[f"alone-{key}"], key
