"""A bounded soak: 200 concurrent streaming clients with mixed lengths and sampling parameters.

Every request must succeed, every streamed text must equal its non-streamed twin (seeded, so the
twin is reproducible), nothing may stay allocated afterwards, and the server's resident memory must
stay flat once warm.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import psutil
import pytest

from tests.sse import DONE, sse_event

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
CLIENTS = 200
DURATION_S = 75.0
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def request_body(rng: random.Random, i: int) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    body = {"model": MODEL, "prompt": f"{i}: {words}", "max_tokens": rng.randint(1, 48),
            "seed": rng.randint(0, 2**31)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0),
                    top_k=rng.choice([0, 5, 50]), presence_penalty=rng.uniform(0, 1))
    return body


async def streamed(client: httpx.AsyncClient, url: str, body: dict) -> str:
    text, done = [], False
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            event = sse_event(line)
            if event == DONE:
                done = True
            elif event is not None:
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    assert done
    return "".join(text)


def server_rss(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def test_soak_200_streaming_clients(tiny_server) -> None:
    url = tiny_server.url
    twins: list[tuple[dict, str]] = []

    async def client_loop(client: httpx.AsyncClient, index: int, deadline: float) -> None:
        rng = random.Random(index)
        count = 0
        while time.monotonic() < deadline:
            body = request_body(rng, index * 1000 + count)
            twins.append((body, await streamed(client, url, body)))
            count += 1

    async def phase(duration: float) -> None:
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            deadline = time.monotonic() + duration
            await asyncio.gather(*(client_loop(client, i, deadline) for i in range(CLIENTS)))

    asyncio.run(phase(10.0))  # warm-up: every code path and buffer touched once
    tiny_server.wait_idle()
    rss_warm = server_rss(tiny_server.process.pid)
    warm_count = len(twins)
    asyncio.run(phase(DURATION_S))
    metrics = tiny_server.wait_idle()
    rss_end = server_rss(tiny_server.process.pid)

    assert metrics["meshserve_kv_cache_free_blocks"] == metrics["meshserve_kv_cache_total_blocks"]
    assert len(twins) - warm_count >= CLIENTS  # every client finished at least one request
    # Memory flat after warm-up: allow allocator noise, not growth with the request count.
    assert rss_end < rss_warm * 1.10, (rss_warm, rss_end)

    async def check_twins() -> None:
        sample = random.Random(0).sample(twins, min(300, len(twins)))
        async with httpx.AsyncClient(timeout=120) as client:
            async def plain(body: dict) -> str:
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            texts = await asyncio.gather(*(plain(body) for body, _ in sample))
        assert texts == [text for _, text in sample]

    asyncio.run(check_twins())
    print(f"soak: {len(twins)} streamed requests from {CLIENTS} clients, "
          f"rss {rss_warm / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB")
