"""Host failure: the lead HostActor of one of two engine replicas killed during traffic. Sequences
that had not started are retried on the other replica, streams already running end with an error
event (never a hang), Serve replaces the replica (its placement group and hosts), and serving
resumes on both."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server import HOSTS, processes, start_server

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
DEADLINE_S = 120


def stream(url: str, prompt: str, max_tokens: int, results: dict, started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    began = time.monotonic()
    outcome = "no-end"
    tokens = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
            if r.status_code != 200:
                outcome = f"status {r.status_code}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome = "error-event"
                    break
                tokens += 1
                started.set()
                if chunk["choices"][0]["finish_reason"]:
                    outcome = chunk["choices"][0]["finish_reason"]
    finally:
        results[prompt] = (outcome, tokens, time.monotonic() - began)


def test_killed_host_is_survived_and_replaced(tiny_llama_dir: str, tmp_path) -> None:
    server = start_server(["--model", tiny_llama_dir, "--num-kv-blocks", "200",
                           "--max-model-len", "512", "--num-replicas", "2"],
                          tmp_path / "serve.log")
    try:
        pids = processes(server.process.pid, HOSTS)
        assert len(pids) == 2
        results: dict = {}
        first_wave = [threading.Event() for _ in range(8)]
        threads = [threading.Thread(target=stream, args=(server.url, f"wave one {i}", 480,
                                                         results, first_wave[i]))
                   for i in range(8)]
        for t in threads:
            t.start()
        for event in first_wave:
            assert event.wait(DEADLINE_S)
        psutil.Process(pids[0]).send_signal(signal.SIGKILL)
        # Requests arriving right after the failure must not be lost.
        second = [threading.Thread(target=stream, args=(server.url, f"wave two {i}", 20,
                                                        results, threading.Event()))
                  for i in range(8)]
        for t in second:
            t.start()
        for t in threads + second:
            t.join(DEADLINE_S + 30)
        assert not any(t.is_alive() for t in threads + second)

        outcomes = {p: r[0] for p, r in results.items()}
        wave_one = [outcomes[f"wave one {i}"] for i in range(8)]
        # The killed replica's running streams end with an error event; the others finish.
        assert set(wave_one) <= {"error-event", "length"}, outcomes
        assert wave_one.count("error-event") >= 1
        assert all(outcomes[f"wave two {i}"] == "length" for i in range(8)), outcomes
        assert all(r[2] < DEADLINE_S for r in results.values())

        deadline = time.monotonic() + DEADLINE_S
        while server.metrics()["meshserve_healthy_replicas"] < 2:
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.5)
        new_pids = processes(server.process.pid, HOSTS)
        assert len(new_pids) == 2 and pids[0] not in new_pids
        after: dict = {}
        third = [threading.Thread(target=stream, args=(server.url, f"after {i}", 10, after,
                                                       threading.Event())) for i in range(6)]
        for t in third:
            t.start()
        for t in third:
            t.join(DEADLINE_S)
        assert len(after) == 6 and all(r[0] == "length" for r in after.values()), after
        metrics = server.wait_idle()
        assert metrics["meshserve_kv_cache_free_blocks"] == \
            metrics["meshserve_kv_cache_total_blocks"]
    finally:
        server.stop()
