"""Sending a run's requests over HTTP: the one module that needs aiohttp.

It speaks only the public ``/v1/completions`` protocol, so the same run measures meshserve and a
peer such as vLLM on the same prompts. Timings are taken here, on the client: they include the
network and the server's HTTP layer, which is what a user sees.

The client shares the machine with the server it measures when both run on one host, so it is
kept cheap: aiohttp reads a 64 x 64 streamed run (32 in flight) for about half the CPU time httpx
took (0.25 against 0.52 CPU-seconds on 2 cores), and uvloop runs it for about three quarters of
what asyncio's own loop took (0.18 against 0.24; ``run``), time the server under test keeps.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
import uvloop

from meshserve.benchmark.prompts import load_prompts
from meshserve.benchmark.results import BenchConfig, BenchResult, RequestResult
from meshserve.benchmark.stream import StreamTimer


T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run one of this module's coroutines to completion on a uvloop event loop, whose
    per-chunk work (a socket read, a wake-up) is done in C: a 64 x 64 streamed run at concurrency
    32 cost this client 0.16-0.19 CPU-seconds against 0.23-0.25 on asyncio's loop (4 runs each,
    2 cores)."""
    return uvloop.run(coroutine)


async def served_model(config: BenchConfig) -> str:
    """The first model a server lists at ``/v1/models`` (vLLM serves its model under the path it
    was given); raises ValueError when it lists none or cannot be reached."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    url = config.completions_url.removesuffix("/completions") + "/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                         headers=headers) as session:
            async with session.get(url) as response:
                models = json.loads(await response.read()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        raise ValueError(f"could not list the models of {url}: {error}") from None
    if not models:
        raise ValueError(f"{url} lists no model; name one with --compare-model")
    return models[0]["id"]


async def _send(session: aiohttp.ClientSession, config: BenchConfig,
                prompt: str) -> RequestResult:
    body = {"model": config.model, "prompt": prompt, "max_tokens": config.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": config.stream}
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    try:
        async with session.post(config.completions_url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode("utf-8", "replace")
                return RequestResult(ok=False, e2e=time.perf_counter() - start,
                                     error=f"HTTP {response.status}: {text[:300]}")
            if not config.stream:
                payload = json.loads(await response.read())
                e2e = time.perf_counter() - start
                usage = payload.get("usage") or {}
                return RequestResult(ok=True, e2e=e2e, ttft=e2e,
                                     output_tokens=usage.get("completion_tokens", 0),
                                     prompt_tokens=usage.get("prompt_tokens"))
            timer = StreamTimer(start)
            async for chunk in response.content.iter_any():  # whatever has arrived, unsplit
                timer.feed(chunk, time.perf_counter())
            return timer.result(time.perf_counter())
    # ValueError: malformed JSON or UTF-8; TimeoutError: the request's own limit passed.
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        return RequestResult(ok=False, e2e=time.perf_counter() - start,
                             error=f"{type(error).__name__}: {error}")


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Send every prompt, at most ``concurrency`` at a time; requests still running when the
    run timeout expires are cancelled and counted as failed."""
    prompts = load_prompts(config)
    semaphore = asyncio.Semaphore(config.concurrency)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=config.concurrency)
    timeout = aiohttp.ClientTimeout(total=config.timeout)

    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=timeout) as session:
        async def bounded(prompt: str) -> RequestResult:
            async with semaphore:
                return await _send(session, config, prompt)

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(bounded(p)) for p in prompts]
        _, pending = await asyncio.wait(tasks, timeout=config.timeout)
        duration = time.perf_counter() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    timed_out = RequestResult(ok=False, e2e=duration,
                              error=f"not finished within the {config.timeout:g} s run timeout")
    return BenchResult(config=config, duration=duration,
                       requests=tuple(timed_out if t in pending else t.result() for t in tasks))
