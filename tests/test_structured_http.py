"""Structured output and tool calls over HTTP, through the openai client: response_format, vLLM's
guided_* extras and structured_outputs, forced and automatic tool calls, streaming and not, and
bad input answered 400 naming the field. The served model is the tiny random Llama, so whatever
obeys a constraint here obeys it by the mask alone."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from meshserve.deploy.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
RECORD = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["a", "b", "c"]}, "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}
CODE = r"[A-Z]{2}-[0-9]{3}"
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Find a record",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                           "maximum": 99},
                                                    "exact": {"type": "boolean"}},
                   "required": ["id", "exact"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                    "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Find record 7."}]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def chat_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    if not stream:
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                max_tokens=120, **kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120,
                                                 stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream: bool) -> None:
    for seed in range(3):
        text, reason = chat_text(client, stream, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "record", "schema": RECORD,
                                                   "strict": True}})
        assert reason == "stop"
        jsonschema.validate(json.loads(text), RECORD)


def test_vllm_extras_in_completions_and_chat(client) -> None:
    got = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, temperature=1.0,
                                    n=3, extra_body={"guided_regex": CODE})
    assert all(re.fullmatch(CODE, c.text) for c in got.choices), got.choices
    stream = client.completions.create(model=MODEL, prompt="Pick", max_tokens=8, stream=True,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert "".join(c.choices[0].text for c in stream) in ("left", "right")
    text, _ = chat_text(client, False, extra_body={"structured_outputs": {
        "grammar": 'root ::= "go " ("north" | "south")'}})
    assert text in ("go north", "go south")
    text, _ = chat_text(client, True, extra_body={"guided_json": RECORD})
    jsonschema.validate(json.loads(text), RECORD)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_carries_valid_arguments(client, stream: bool) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0,
                  tools=[LOOKUP, CLOCK],
                  tool_choice={"type": "function", "function": {"name": "lookup"}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
    else:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        first = deltas[0]
        assert first.id and first.type == "function" and first.index == 0
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        assert len(deltas) > 2  # the arguments arrived piece by piece
        name, call_id = first.function.name, first.id
        arguments = "".join(d.function.arguments or "" for d in deltas)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert name == "lookup" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), LOOKUP["function"]["parameters"])


def test_required_tool_calls_name_a_tool_and_obey_its_schema(client) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (LOOKUP, CLOCK)}
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed,
            tools=[LOOKUP, CLOCK], tool_choice="required",
            parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_auto_with_a_template_that_defines_no_tool_format_returns_plain_content(client) -> None:
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                            temperature=0, tools=[LOOKUP]).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason == "length"


@pytest.mark.parametrize("kwargs, param", [
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_grammar": "root ::= nowhere"}}, "guided_grammar"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}], "tool_choice": "auto"},
     "tools[0].function.parameters"),
    ({"tools": [LOOKUP], "tool_choice": "required", "extra_body": {"guided_regex": "a"}},
     "tool_choice"),
])
def test_bad_constraints_get_400_naming_the_field(client, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body
    # The server goes on serving everyone else.
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                        temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_unset_sampling_fields_take_the_models_defaults() -> None:
    body = ChatCompletionRequest(model=MODEL, messages=MESSAGES, top_p=0.5)
    defaults = {"temperature": 0.3, "top_p": 0.9, "top_k": 20}
    params = body.sampling_params(16, None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.3, 0.5, 20, 0.0)
    neutral = body.sampling_params(16, None, {})
    assert (neutral.temperature, neutral.top_p, neutral.top_k) == (1.0, 0.5, 0)


# --- prompt logprobs ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str):
    """The offline engine on the same weights and dtype as the server: its prompt logprobs are
    checked against transformers' log-softmax (tests/test_engine_correctness.py)."""
    from meshserve import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=128, max_model_len=512)
    return llm.generate(["The quick brown fox jumps over"],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]


def test_echo_with_logprobs_returns_the_prompt_tokens_logprobs(client, reference) -> None:
    ids, expected = reference.prompt_token_ids, reference.prompt_logprobs
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=reference.prompt, max_tokens=2,
                                        temperature=0, echo=True, logprobs=3, stream=stream)
        chunks = list(got) if stream else [got]
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        token_logprobs = [v for lp in logprobs for v in lp.token_logprobs]
        offsets = [v for lp in logprobs for v in lp.text_offset]
        assert len(token_logprobs) == len(ids) + 2 and token_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(token_logprobs[i] - expected[i][ids[i]].logprob) < 1e-5
        assert offsets == sorted(offsets) and offsets[0] == 0


def test_vllm_prompt_logprobs_in_completions_and_chat(tiny_server, reference) -> None:
    import httpx

    ids, expected = reference.prompt_token_ids, reference.prompt_logprobs
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    got = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()
    prompt_logprobs = got["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i][str(ids[i])]
        assert abs(entry["logprob"] - expected[i][ids[i]].logprob) < 1e-5
        assert entry["rank"] == min(expected[i][ids[i]].rank, 3)  # past the top 2: "3"
        assert 2 <= len(prompt_logprobs[i]) <= 3  # the top 2 and the prompt's own token
    chat = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
