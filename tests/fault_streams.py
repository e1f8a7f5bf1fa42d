"""Streamed completions for the fault tests: waves of them in threads, and how each one ended."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

from tests.server import Server
from tests.sse import DONE, sse_events

MODEL = "tiny-llama"


@dataclass(frozen=True)
class Outcome:
    """How one stream ended: a finish reason, "error-event", "status N" or "no-end"."""

    end: str
    tokens: int
    seconds: float  # from the request to the end of the stream
    ended_at: float  # time.monotonic() then


def stream(url: str, prompt: str, max_tokens: int, results: dict[str, Outcome],
           started: threading.Event, timeout: float) -> None:
    """Stream one completion of ``prompt``; set ``started`` at its first token and record its
    ``Outcome`` in ``results[prompt]``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    began = time.monotonic()
    end = "no-end"
    tokens = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                end = f"status {r.status_code}"
                return
            for event in sse_events(r.iter_lines()):
                if event == DONE:
                    continue
                if "error" in event:
                    end = "error-event"
                    break
                tokens += 1
                started.set()
                if event["choices"][0]["finish_reason"]:
                    end = event["choices"][0]["finish_reason"]
    finally:
        now = time.monotonic()
        results[prompt] = Outcome(end, tokens, now - began, now)


class Wave:
    """``count`` streams with prompts ``"{name} 0"``, ``"{name} 1"``..., started at once, each in
    a thread of its own; their outcomes land in ``results``."""

    def __init__(self, url: str, name: str, count: int, max_tokens: int,
                 results: dict[str, Outcome], timeout: float) -> None:
        self.prompts = [f"{name} {i}" for i in range(count)]
        self.started = [threading.Event() for _ in self.prompts]
        self.threads = [threading.Thread(target=stream, args=(url, prompt, max_tokens, results,
                                                              started, timeout))
                        for prompt, started in zip(self.prompts, self.started)]
        for thread in self.threads:
            thread.start()

    def wait_started(self, timeout: float) -> None:
        """Return once every stream has had its first token; fail after ``timeout`` s."""
        for event in self.started:
            assert event.wait(timeout), "generation did not start"

    def join(self, timeout: float) -> None:
        """Wait until every stream has ended; fail if one is still running after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"


def assert_serves_again(server: Server, timeout: float) -> None:
    """Six new streams all finish, and once idle every KV block is free again."""
    after: dict[str, Outcome] = {}
    Wave(server.url, "after", 6, 10, after, timeout).join(timeout)
    assert len(after) == 6 and all(o.end == "length" for o in after.values()), after
    metrics = server.wait_idle()
    assert metrics["meshserve_kv_cache_free_blocks"] == metrics["meshserve_kv_cache_total_blocks"]
