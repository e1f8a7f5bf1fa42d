"""Graceful drain: on SIGTERM the server stops taking requests, lets in-flight ones finish within
the deadline, ends the rest with an error event, frees every KV block, and exits."""

from __future__ import annotations

import re
import signal
import threading

import httpx
import pytest

from tests.server import start_server
from tests.sse import DONE, sse_events

pytestmark = pytest.mark.slow


def test_sigterm_drains_in_flight_requests(tiny_llama_dir: str, tmp_path) -> None:
    log = tmp_path / "serve.log"
    server = start_server(["--model", tiny_llama_dir, "--num-kv-blocks", "200",
                           "--max-model-len", "512", "--drain-timeout", "0.5"], log)
    endings: dict[str, str] = {}
    streaming = threading.Barrier(4)

    def stream(name: str, max_tokens: int) -> None:
        body = {"model": "tiny-llama", "prompt": name, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            events = sse_events(r.iter_lines())
            received = [next(events)]
            streaming.wait()
            received.extend(events)
        last = received[-2] if received[-1] == DONE else received[-1]
        endings[name] = ("error" if "error" in last
                         else last["choices"][0]["finish_reason"] or "cut")

    # Two short requests that finish within the deadline, one far too long to.
    threads = [threading.Thread(target=stream, args=(name, n)) for name, n in
               (("short-a", 4), ("short-b", 4), ("long", 480))]
    for t in threads:
        t.start()
    streaming.wait()  # every stream has started
    server.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    server.process.wait(timeout=120)

    assert endings == {"short-a": "length", "short-b": "length", "long": "error"}
    text = log.read_text()
    match = re.search(r"drained: (\d+) finished, (\d+) cancelled; (\d+)/(\d+) KV blocks free", text)
    assert match, text[-3000:]
    finished, cancelled, free, total = map(int, match.groups())
    assert cancelled == 1 and finished <= 2
    assert free == total > 0
    assert "meshserve: draining" in text
    assert "killed by `ray.kill`" not in text  # the shutdown after it is quiet
