"""The bad-input catalogue, at the HTTP API and the Python API.

Each row is one bad request and what must come back. Every one gets a clear 4xx (or ValueError),
and the server, or engine, goes on serving. Add a row to extend the catalogue.
"""

from __future__ import annotations

import httpx
import pytest

from meshserve import LLM, SamplingParams

MODEL = "tiny-llama"
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def completion(**changes) -> dict:
    body = dict(OK, **changes)
    return {k: v for k, v in body.items() if v is not ...}  # `...` removes a field


def chat(**changes) -> dict:
    body = dict(CHAT, **changes)
    return {k: v for k, v in body.items() if v is not ...}


# (case id, method, path, JSON body or raw bytes, expected status, expected `param` or None)
HTTP_CASES = [
    ("malformed json", "POST", "/v1/completions", b"{bad", 400, None),
    ("invalid utf-8", "POST", "/v1/completions", b"\xff\xfe\x00garbage", 400, None),
    ("json array body", "POST", "/v1/completions", b"[]", 400, None),
    ("missing model", "POST", "/v1/completions", completion(model=...), 400, "model"),
    ("missing prompt", "POST", "/v1/completions", completion(prompt=...), 400, "prompt"),
    ("prompt wrong type", "POST", "/v1/completions", completion(prompt=123), 400, "prompt"),
    ("empty prompt", "POST", "/v1/completions", completion(prompt=""), 400, "prompt"),
    ("empty prompt list", "POST", "/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("empty token list", "POST", "/v1/completions", completion(prompt=[[]]), 400, "prompt"),
    ("token id beyond vocab", "POST", "/v1/completions", completion(prompt=[10**8]), 400,
     "prompt"),
    ("negative token id", "POST", "/v1/completions", completion(prompt=[5, -1]), 400, "prompt"),
    ("prompt over context", "POST", "/v1/completions",
     completion(prompt=" ".join(["word"] * 600)), 400, "prompt"),
    ("max_tokens beyond context", "POST", "/v1/completions", completion(max_tokens=10_000), 400,
     "max_tokens"),
    ("max_tokens zero", "POST", "/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", "POST", "/v1/completions", completion(max_tokens=-5), 400,
     "max_tokens"),
    ("max_tokens huge", "POST", "/v1/completions", completion(max_tokens=10**15), 400,
     "max_tokens"),
    ("temperature string", "POST", "/v1/completions", completion(temperature="hot"), 400,
     "temperature"),
    ("temperature negative", "POST", "/v1/completions", completion(temperature=-1), 400,
     "temperature"),
    ("top_p zero", "POST", "/v1/completions", completion(top_p=0), 400, "top_p"),
    ("top_p above one", "POST", "/v1/completions", completion(top_p=1.5), 400, "top_p"),
    ("n zero", "POST", "/v1/completions", completion(n=0), 400, "n"),
    ("n too large", "POST", "/v1/completions", completion(n=1000), 400, "n"),
    ("logprobs too many", "POST", "/v1/completions", completion(logprobs=50), 400, "logprobs"),
    ("stop list too long", "POST", "/v1/completions", completion(stop=["x"] * 20), 400, "stop"),
    ("empty stop string", "POST", "/v1/completions", completion(stop=[""]), 400, "stop"),
    ("presence penalty out of range", "POST", "/v1/completions",
     completion(presence_penalty=5), 400, "presence_penalty"),
    ("seed negative", "POST", "/v1/completions", completion(seed=-1), 400, "seed"),
    ("stop_token_ids negative", "POST", "/v1/completions", completion(stop_token_ids=[-1]), 400,
     "stop_token_ids"),
    ("stop_token_ids too many", "POST", "/v1/completions",
     completion(stop_token_ids=list(range(100))), 400, "stop_token_ids"),
    # Fields meshserve does not implement fail when they ask for something.
    ("logit_bias", "POST", "/v1/completions", completion(logit_bias={"5": 10}), 400,
     "logit_bias"),
    ("suffix", "POST", "/v1/completions", completion(suffix="end"), 400, "suffix"),
    ("best_of above n", "POST", "/v1/completions", completion(best_of=3), 400, "best_of"),
    ("min_tokens", "POST", "/v1/completions", completion(min_tokens=2), 400, "min_tokens"),
    ("use_beam_search", "POST", "/v1/completions", completion(use_beam_search=True), 400,
     "use_beam_search"),
    ("chat logit_bias", "POST", "/v1/chat/completions", chat(logit_bias={"5": 10}), 400,
     "logit_bias"),
    ("unknown model", "POST", "/v1/completions", completion(model="gpt-9"), 404, "model"),
    ("chat empty messages", "POST", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("chat missing messages", "POST", "/v1/chat/completions", chat(messages=...), 400,
     "messages"),
    ("chat unknown role", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("chat content wrong type", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": 123}]), 400, "messages.0.content"),
    ("chat top_logprobs too many", "POST", "/v1/chat/completions",
     chat(logprobs=True, top_logprobs=25), 400, "top_logprobs"),
    ("chat unknown model", "POST", "/v1/chat/completions", chat(model="nope"), 404, "model"),
    ("oversized body", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}',
     413, None),
    ("wrong method", "GET", "/v1/completions", None, 405, None),
    ("unknown route", "GET", "/v1/nothing", None, 404, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, method, path, body, status, param", HTTP_CASES,
                         ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(tiny_server, case, method, path, body, status, param) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    if body is None:
        kwargs = {}
    response = httpx.request(method, f"{tiny_server.url}{path}", timeout=60,
                             headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    # ... and the next good request succeeds.
    good = httpx.post(f"{tiny_server.url}/v1/completions", json=OK, timeout=60)
    assert good.status_code == 200 and good.json()["choices"][0]["text"]


# (case id, prompts, SamplingParams kwargs, text that the ValueError must contain)
PYTHON_CASES = [
    ("empty prompt list", [], {}, "prompts"),
    ("empty token list", [[]], {}, "prompt"),
    ("empty string", [""], {}, "prompt"),
    ("wrong prompt type", [3.5], {}, "prompts"),
    ("token beyond vocab", [[10**8]], {}, "prompt"),
    ("negative token", [[-3]], {}, "prompt"),
    ("prompt over context", [[7] * 600], {}, "max_model_len"),
    ("negative temperature", ["hi"], {"temperature": -1.0}, "temperature"),
    ("top_p zero", ["hi"], {"top_p": 0.0}, "top_p"),
    ("max_tokens zero", ["hi"], {"max_tokens": 0}, "max_tokens"),
    ("n zero", ["hi"], {"n": 0}, "n"),
    ("logprobs too many", ["hi"], {"logprobs": 21}, "logprobs"),
    ("empty stop string", ["hi"], {"stop": [""]}, "stop"),
]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, device="cpu", num_kv_blocks=128, max_model_len=512)


@pytest.mark.parametrize("case, prompts, params, message", PYTHON_CASES,
                         ids=[c[0] for c in PYTHON_CASES])
def test_python_bad_input(llm: LLM, case, prompts, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, SamplingParams(**params))
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished
    assert bm.num_free_blocks == bm.num_total_blocks
    assert llm.generate(["hi"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
