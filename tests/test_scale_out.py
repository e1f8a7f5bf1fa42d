"""No single process in the token path: two ingress replicas in front of two engine replicas.

Both ingress replicas listen on the serve port themselves (no Serve proxy runs), every replica of
either deployment carries traffic, and killing the process that routes (an ingress
replica: routing runs in each caller's handle) under streaming load costs only the streams it
carried: new requests are answered at once, no host actor is restarted or warms up again, and
the sequences of the dead ingress are aborted on the engines, freeing every KV block.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server import HOSTS, INGRESS, processes, start_server
from tests.sse import DONE, sse_events

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
HEADER = "x-meshserve-ingress"
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time in a land far away", "1 2 3"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve-scale-out.log"
    server = start_server(["--model", tiny_llama_dir, "--num-kv-blocks", "300",
                           "--max-model-len", "512", "--num-replicas", "2",
                           "--ingress-replicas", "2"], log)
    yield server
    server.stop()


def _sse_text(lines) -> tuple[str, bool]:
    """The text of a completions stream and whether it ended with [DONE] (no error event)."""
    pieces, done = [], False
    for event in sse_events(lines):
        if event == DONE:
            done = True
        elif "error" in event:
            return "".join(pieces), False
        else:
            pieces.append(event["choices"][0]["text"])
    return "".join(pieces), done


def test_every_ingress_replica_listens_on_the_serve_port_and_no_proxy_runs(server) -> None:
    ingress = processes(server.process.pid, INGRESS)
    listening = [pid for pid in server.listeners() if pid in ingress]
    assert len(listening) == 2, listening
    assert processes(server.process.pid, "ProxyActor") == []


def test_ray_and_serve_background_loops_run_at_the_calm_pace_on_its_own_ray(server) -> None:
    # cli.py slows Serve's controller loop, the replicas' metrics export and Ray's log and
    # autoscaler monitors, and turns Ray's metrics collection off, before its local Ray starts,
    # so every process of that cluster runs with them.
    from meshserve.cli import CALM_RAY_ENV

    pids = [*processes(server.process.pid, "ServeController"),
            *processes(server.process.pid, INGRESS),
            *processes(server.process.pid, "ray/_private/log_monitor.py"),
            *processes(server.process.pid, "ray/autoscaler/_private/monitor.py")]
    assert len(pids) == 5, pids
    for pid in pids:
        env = psutil.Process(pid).environ()
        assert {name: env.get(name) for name in CALM_RAY_ENV} == CALM_RAY_ENV, pid


def test_64_streams_through_two_ingress_replicas_equal_their_twins(server) -> None:
    async def run() -> None:
        prompts = [f"Item {i}: {PROMPTS[i % len(PROMPTS)]} number {i * 7}" for i in range(64)]
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0}
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=80)) as c:
            async def streamed(prompt: str) -> tuple[str, str]:
                async with c.stream("POST", f"{server.url}/v1/completions",
                                    json={**body, "prompt": prompt, "stream": True}) as r:
                    assert r.status_code == 200
                    text, done = _sse_text([line async for line in r.aiter_lines()])
                    assert done
                    return text, r.headers[HEADER]

            async def plain(prompt: str) -> tuple[str, str]:
                r = await c.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"], r.headers[HEADER]

            streams = await asyncio.gather(*(streamed(p) for p in prompts))
            twins = await asyncio.gather(*(plain(p) for p in prompts))
        assert all(text for text, _ in streams)
        assert [text for text, _ in streams] == [text for text, _ in twins]
        # Both ingress replicas carried streams (the kernel spreads connections over them).
        ingresses = {replica for _, replica in streams}
        assert len(ingresses) == 2, ingresses

    asyncio.run(run())


def _stream(url: str, prompt: str, results: dict, started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}
    outcome = "cut"
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            results[prompt] = ("open", r.headers.get(HEADER))
            for event in sse_events(r.iter_lines()):
                started.set()
                if event == DONE:
                    outcome = "done"
    except httpx.HTTPError:
        outcome = "cut"
    finally:
        results[prompt] = (outcome, results.get(prompt, (None, None))[1])


def test_killing_an_ingress_replica_under_load_restarts_no_engine(server) -> None:
    engines = processes(server.process.pid, HOSTS)
    ingresses = processes(server.process.pid, INGRESS)
    assert len(engines) == 2 and len(ingresses) == 2
    results: dict = {}
    started = [threading.Event() for _ in range(16)]
    threads = [threading.Thread(target=_stream, args=(server.url, f"load {i}", results,
                                                      started[i]), daemon=True)
               for i in range(16)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120)

    killed_at = time.monotonic()
    victim = psutil.Process(ingresses[0])
    victim.send_signal(signal.SIGKILL)
    # Its listening socket closes only once the process has exited; until then the kernel still
    # queues some new connections on it (SO_REUSEPORT spreads them over every replica's socket),
    # and those are reset when it closes. A client sees that as a failed connection, as from any
    # server that dies; what this test asks is that serving goes on once it is gone.
    # A socket no process owns is the victim's, closing (``Server.socket_owners``).
    while any(owner in (victim.pid, None) for owner in server.socket_owners()):
        assert time.monotonic() - killed_at < 30, "the killed ingress replica's socket stayed open"
        time.sleep(0.05)
    answered_after = None
    while time.monotonic() - killed_at < 30:
        try:
            r = httpx.post(f"{server.url}/v1/completions", timeout=10, json={
                "model": MODEL, "prompt": "after the kill", "max_tokens": 4})
            if r.status_code == 200:
                answered_after = time.monotonic() - killed_at
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert answered_after is not None, "no request was answered within 30 s of the kill"
    for i in range(8):  # and serving goes on
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": f"still serving {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text

    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    outcomes = [outcome for outcome, _ in results.values()]
    # The streams the dead replica carried were cut; the other replica's finished.
    assert "cut" in outcomes and "done" in outcomes, results

    # No host actor was touched: same processes, and none warmed up twice (Ray may print a
    # host's line late, so lines are told apart by the process that printed them).
    assert processes(server.process.pid, HOSTS) == engines
    warmed = re.findall(r"pid=(\d+)\)[^\n]*?meshserve: warm-up done", server.log.read_text())
    assert len(warmed) == len(set(warmed)) and set(map(int, warmed)) <= set(engines), warmed
    # The dead replica's sequences were aborted on the engines once its lease ran out.
    metrics = server.wait_idle(timeout=90)
    assert metrics["meshserve_kv_cache_free_blocks"] == \
        metrics["meshserve_kv_cache_total_blocks"] > 0
    assert metrics["meshserve_healthy_replicas"] == 2
