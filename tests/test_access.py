"""Access and overload: an API key guards every /v1 route, health stays open, and past the queue
bound the server answers 429 with Retry-After instead of queueing without limit."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server import start_server

pytestmark = pytest.mark.slow

KEY = "test-key-123"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: str, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve-guarded.log"
    server = start_server(["--model", tiny_llama_dir, "--num-kv-blocks", "200",
                           "--max-model-len", "512", "--max-queued-requests", "4"], log,
                          env={"MESHSERVE_API_KEY": KEY})
    yield server
    server.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions")])
@pytest.mark.parametrize("key", [None, "wrong"])
def test_api_key_required_on_v1(guarded, method: str, path: str, key: str | None) -> None:
    headers = {} if key is None else auth(key)
    body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.request(method, f"{guarded.url}{path}", headers=headers, timeout=60,
                             json=body if method == "POST" else None)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_health_open_and_key_accepted(guarded) -> None:
    assert httpx.get(f"{guarded.url}/health", timeout=30).status_code == 200
    ok = httpx.post(f"{guarded.url}/v1/completions", headers=auth(KEY), timeout=60,
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200


def test_overload_answers_429_with_retry_after(guarded) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post(f"{guarded.url}/v1/completions", headers=auth(KEY), json={
            "model": MODEL, "prompt": f"request {i}", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 4
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 60
    metrics = guarded.wait_idle()
    assert metrics["meshserve_kv_cache_free_blocks"] == metrics["meshserve_kv_cache_total_blocks"]
