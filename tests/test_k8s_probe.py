"""The TPU workers' readiness probe (meshserve.kuberay.probe) against servers that answer, fail,
stall or are not there, and once against a real ``meshserve serve``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshserve.kuberay.probe import ProbeFailure, probe
from tests.server import free_port

COMPLETION = {"object": "text_completion", "choices": [
    {"index": 0, "text": " pong", "finish_reason": "length"}]}


class Stub(ThreadingHTTPServer):
    """A raylet agent and a Serve proxy in one: what each path answers is set per test."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.raylet = b"success"
        self.completion: tuple[int, dict] = (200, COMPLETION)
        self.stall = threading.Event()  # set: the completion never answers
        self.requests: list[tuple[str, dict, dict]] = []

    @property
    def port(self) -> int:
        return self.server_address[1]


class Handler(BaseHTTPRequestHandler):
    server: Stub

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.requests.append((self.path, dict(self.headers), {}))
        self._send(200, self.server.raylet)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))
        if self.server.stall.is_set():
            time.sleep(5)  # longer than any deadline below
            return
        status, answer = self.server.completion
        self._send(status, json.dumps(answer).encode())


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run(stub: Stub, **kwargs) -> None:
    probe("tiny", port=stub.port, agent_port=stub.port, **kwargs)


def test_healthy_path_sends_one_greedy_token_with_the_key(stub: Stub) -> None:
    run(stub, api_key="secret")
    (raylet, _, _), (path, headers, body) = stub.requests
    assert raylet == "/api/local_raylet_healthz"
    assert path == "/v1/completions"
    assert body == {"model": "tiny", "prompt": "ping", "max_tokens": 1, "temperature": 0}
    assert headers["Authorization"] == "Bearer secret"


def test_a_stalled_completion_fails_within_the_deadline(stub: Stub) -> None:
    stub.stall.set()
    start = time.monotonic()
    with pytest.raises(ProbeFailure, match="one-token completion: .*timed out"):
        run(stub, deadline_s=0.5)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("status, answer, message", [
    (500, {"error": {"message": "host 1 failed"}}, "HTTP 500: .*host 1 failed"),
    (429, {"error": {"message": "overloaded"}}, "HTTP 429"),
    (200, {"choices": []}, "no finished choice"),
    (200, {"detail": "not openai"}, "not an OpenAI completion"),
])
def test_a_failed_completion_is_unhealthy(stub: Stub, status: int, answer: dict,
                                          message: str) -> None:
    stub.completion = (status, answer)
    with pytest.raises(ProbeFailure, match=message):
        run(stub)


def test_a_dead_raylet_or_no_proxy_is_unhealthy(stub: Stub) -> None:
    stub.raylet = b"raylet is dead"
    with pytest.raises(ProbeFailure, match="raylet health: unexpected answer"):
        run(stub)
    # A follower host runs no Serve proxy: nothing listens on its serve port.
    with pytest.raises(ProbeFailure, match="one-token completion: .*refused"):
        probe("tiny", port=free_port(), agent_port=None)


def test_the_command_the_kubelet_runs_exits_by_health(stub: Stub) -> None:
    command = [sys.executable, "-m", "meshserve.kuberay.probe", "--model", "tiny",
               "--port", str(stub.port), "--agent-port", str(stub.port), "--deadline", "2"]
    ok = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, "healthy")
    stub.completion = (503, {"error": {"message": "draining"}})
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert bad.stdout.startswith("unhealthy: one-token completion: HTTP 503")


@pytest.mark.slow
def test_the_probe_passes_against_meshserve_serve(tiny_server) -> None:
    port = tiny_server.port
    probe("tiny-llama", port=port, agent_port=None, deadline_s=30)
    with pytest.raises(ProbeFailure, match="HTTP 404"):  # a model the server does not serve
        probe("not-served", port=port, agent_port=None, deadline_s=30)
