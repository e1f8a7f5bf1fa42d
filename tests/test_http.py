"""The OpenAI-compatible endpoint, served as the README serves it, driven by the openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from meshserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time in a land far away",
           "1 2 3"]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, device="cpu", num_kv_blocks=400, max_model_len=512)


def greedy_text(llm: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outs]


def stream_text(client: openai.OpenAI, **kwargs) -> tuple[str, list]:
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def ending(chunks: list) -> tuple:
    """The finish reason and vLLM's stop reason on the last choice chunk of a stream."""
    last = [c.choices[0] for c in chunks if c.choices][-1].model_dump()
    return last["finish_reason"], last.get("stop_reason")


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_greedy_completions_equal_llm_generate(client, reference) -> None:
    expected = greedy_text(reference, PROMPTS, 16)
    for prompt, text in zip(PROMPTS, expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                        temperature=0)
        assert got.choices[0].text == text
        streamed, _ = stream_text(client, model=MODEL, prompt=prompt, max_tokens=16,
                                  temperature=0)
        assert streamed == text


def test_prompt_list_keeps_order_and_counts_usage(client, reference) -> None:
    tok = reference.tokenizer
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in got.choices] == greedy_text(reference, PROMPTS, 5)
    assert got.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert got.usage.completion_tokens == 5 * len(PROMPTS)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompts(client, reference) -> None:
    ids = [[101, 202, 303], [404, 505]]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    outs = reference.generate(ids, SamplingParams(temperature=0, max_tokens=6))
    assert [c.text for c in got.choices] == [o.outputs[0].text for o in outs]
    assert got.usage.prompt_tokens == 5


def test_n_samples_are_seeded_and_distinct(client) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text
    assert first.usage.completion_tokens == 16


def test_stop_sequence(client, reference) -> None:
    full = greedy_text(reference, PROMPTS[:1], 16)[0]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0, stop=[stop])
    assert got.choices[0].text == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_dump()["stop_reason"] == stop
    streamed, chunks = stream_text(client, model=MODEL, prompt=PROMPTS[0], max_tokens=16,
                                   temperature=0, stop=[stop])
    assert streamed == got.choices[0].text
    assert ending(chunks) == ("stop", stop)


def test_stop_token_ids_and_include_stop_str_in_output(client, reference) -> None:
    free = reference.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[4]
    texts = []
    for include in (False, True):
        extra = {"stop_token_ids": [stop_at], "include_stop_str_in_output": include}
        want = reference.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12,
                                                              **extra))[0].outputs[0]
        assert want.finish_reason == "stop" and want.token_ids[-1] == stop_at
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                "extra_body": extra}
        got = client.completions.create(**body)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "stop"
        assert got.choices[0].model_dump()["stop_reason"] == stop_at
        assert got.usage.completion_tokens == len(want.token_ids)
        streamed, chunks = stream_text(client, **body)
        assert streamed == want.text
        assert ending(chunks) == ("stop", stop_at)
        texts.append(want.text)
    assert texts[0] != texts[1] and texts[1].startswith(texts[0])


def test_logprobs_and_echo(client, reference) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6,
                                    temperature=0, logprobs=3, echo=True)
    choice = got.choices[0]
    assert choice.text.startswith(PROMPTS[1])
    out = reference.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6,
                                                          logprobs=3))[0].outputs[0]
    assert choice.text == PROMPTS[1] + out.text
    # Echo with logprobs: the prompt's tokens first (the very first without a logprob, as in
    # OpenAI's API), then the generated ones.
    lp = choice.logprobs
    n = len(reference.tokenizer.encode(PROMPTS[1]))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    for token, value, step in zip(out.token_ids, lp.token_logprobs[n:], out.logprobs):
        assert value == pytest.approx(step[token].logprob, abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs[n:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPTS[1])


def test_chat_completion_and_stream(client, reference) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    tok = reference.tokenizer
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    expected = reference.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=12))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=2)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected[0].outputs[0].text
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(expected[0].outputs[0].token_ids)
    assert len(got.choices[0].logprobs.content) == got.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == got.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    assert ending(chunks) == ("length", None)
    assert got.choices[0].model_dump()["stop_reason"] is None
    # A stop string ends the chat's content before it, and is its stop reason.
    full = got.choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                             temperature=0, stop=[stop])
    assert stopped.choices[0].message.content == full[:full.index(stop)]
    assert stopped.choices[0].model_dump()["stop_reason"] == stop


def test_64_concurrent_streams_equal_non_streamed(server) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                    max_retries=0, timeout=300)
        prompts = [f"Item {i}: {PROMPTS[i % len(PROMPTS)]} number {i * 7}" for i in range(64)]

        async def streamed(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def plain(prompt: str) -> str:
            got = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                  temperature=0)
            return got.choices[0].text

        streamed_texts = await asyncio.gather(*(streamed(p) for p in prompts))
        plain_texts = await asyncio.gather(*(plain(p) for p in prompts))
        assert all(streamed_texts)
        assert streamed_texts == plain_texts
        await client.close()

    asyncio.run(run())


def test_client_disconnect_frees_blocks(server) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines) if line]
            assert all(line.startswith("data: {") for line in received)
        # Leaving the block closes the connection mid-stream.
    metrics = server.wait_idle()
    assert metrics["meshserve_num_requests_running"] == 0
    assert metrics["meshserve_kv_cache_free_blocks"] == metrics["meshserve_kv_cache_total_blocks"]
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200


def test_metrics_report_traffic(server) -> None:
    m = server.metrics()
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for name in ("meshserve_requests_total{status=\"ok\"}", "meshserve_prompt_tokens_total",
                 "meshserve_generation_tokens_total", "meshserve_time_to_first_token_seconds",
                 "meshserve_time_per_output_token_seconds",
                 "meshserve_e2e_request_latency_seconds", "meshserve_num_requests_running",
                 "meshserve_num_requests_waiting", "meshserve_kv_cache_usage_ratio"):
        assert name in text
    assert m["meshserve_generation_tokens_total"] > 0
    assert m["meshserve_time_to_first_token_seconds_count"] > 0
    # The engine's own step counters reach /metrics.
    assert m["meshserve_engine_steps"] > 0
    assert m["meshserve_engine_execute_seconds"] > 0
    assert 0 <= m["meshserve_engine_cpu_wait_seconds"] <= m["meshserve_engine_execute_seconds"]
    assert json.loads(httpx.get(f"{server.url}/v1/models", timeout=30).text)["data"][0][
        "max_model_len"] == 512
