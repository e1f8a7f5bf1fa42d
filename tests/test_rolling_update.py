"""A rolling update under streaming load, as KubeRay applies a changed ``serveConfigV2``: Serve
starts replicas of the new version and stops the old ones while clients keep streaming. Every
request in flight or arriving meanwhile completes: old engine replicas retire (their running
sequences finish there, then they leave), new sequences go to replicas that take them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import httpx
import pytest
from ray import serve

from meshserve.deploy.app import build_app
from meshserve.deploy.settings import ServeSettings
from tests.local_cluster import local_cluster
from tests.server import free_port
from tests.sse import DONE, sse_events

pytestmark = pytest.mark.slow

ARGS = dict(device="cpu", block_size=16, num_kv_blocks=64, max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=256, num_replicas=2)
MAX_TOKENS = 150
CLIENTS = 4
REQUESTS_CAP = 400  # a bound on the load, whatever the update's length


@dataclass
class Outcome:
    status: int
    tokens: int  # completion tokens the stream carried
    finish: str | None
    done: bool  # the stream ended with [DONE]


def _stream(url: str, model: str, prompt: str) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    finish, tokens, done = None, 0, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as response:
        if response.status_code != 200:
            response.read()
            return Outcome(response.status_code, 0, response.text, False)
        for event in sse_events(response.iter_lines()):
            if event == DONE:
                done = True
                continue
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return Outcome(200, tokens, finish, done)


def test_streams_complete_through_a_rolling_update_of_every_replica(tiny_llama_dir: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with local_cluster(head_cpus=8):
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        try:
            old = ServeSettings.from_args({"model": tiny_llama_dir, **ARGS})
            serve.run(build_app(old), name="meshserve", route_prefix="/")
            model = old.model_name()
            # The new version differs in a setting both deployments are built with, so Serve
            # replaces every ingress and engine replica.
            new = ServeSettings.from_args({"model": tiny_llama_dir, **ARGS,
                                           "max_queued_requests": old.max_queued_requests + 1})
            outcomes: list[Outcome] = []
            lock = threading.Lock()
            updated = threading.Event()

            def client(index: int) -> None:
                # Streams one request after another, the last one started after the update.
                n = 0
                while len(outcomes) < REQUESTS_CAP:
                    last = updated.is_set()
                    outcome = _stream(url, model, f"Client {index}, request {n}: once upon a time")
                    n += 1
                    with lock:
                        outcomes.append(outcome)
                    if last:
                        return

            threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
            for thread in threads:
                thread.start()
            try:
                serve.run(build_app(new), name="meshserve", route_prefix="/")
            finally:
                updated.set()
                for thread in threads:
                    thread.join(timeout=300)
            assert not any(thread.is_alive() for thread in threads)

            failed = [o for o in outcomes if (o.status, o.tokens, o.finish, o.done)
                      != (200, MAX_TOKENS, "length", True)]
            assert not failed, failed
            # Streams ran through the update (it takes a new replica's load and warm-up), not
            # only before or after it.
            assert len(outcomes) >= 4 * CLIENTS, len(outcomes)
            assert len(outcomes) < REQUESTS_CAP
            engines = serve.status().applications["meshserve"].deployments["Engine"]
            assert engines.status == "HEALTHY"
            assert engines.replica_states.get("RUNNING") == ARGS["num_replicas"]
        finally:
            serve.shutdown()
