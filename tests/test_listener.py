"""The ingress replicas' own HTTP listener (``meshserve serve``'s default edge): replicas share the
serve port, anything else holding it is refused with a message naming the address (before the
server starts anything), and a listener that closes lets the responses in flight finish. With
``--edge proxy`` Serve's proxy listens on the serve port instead."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx
import psutil
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from meshserve.deploy.listener import IngressListener, listening_socket
from tests.server import start_server


def test_replicas_share_the_port_and_nothing_else_can_take_it() -> None:
    first = listening_socket("127.0.0.1", 0, shared=True)
    port = first.getsockname()[1]
    second = listening_socket("127.0.0.1", port, shared=True)  # another replica on the node
    try:
        first.listen()
        second.listen()
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: "
                                          "Address already in use"):
            listening_socket("127.0.0.1", port, shared=False)
    finally:
        first.close()
        second.close()


def test_serve_refuses_a_taken_port_before_starting_anything() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "meshserve.cli", "serve", "--port",
                                 str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        f"cannot listen on 127.0.0.1:{port}: Address already in use"), result.stderr
    assert "loading" not in result.stdout  # no Ray, no model


def test_closing_stops_accepting_and_lets_streams_in_flight_finish() -> None:
    app = FastAPI()
    release = asyncio.Event()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            yield "first\n"
            await release.wait()
            yield "last\n"
        return StreamingResponse(chunks())

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    async def run() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        listener = IngressListener(app, "127.0.0.1", port, shutdown_timeout_s=30)
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=30) as client:
            while True:  # serving starts on the loop, just after the constructor
                try:
                    assert (await client.get(f"{url}/ping")).json() == "pong"
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            async with client.stream("GET", f"{url}/stream") as response:
                lines = response.aiter_lines()
                assert await anext(lines) == "first"
                closing = asyncio.ensure_future(listener.close())
                async with httpx.AsyncClient(timeout=30) as fresh:
                    while True:  # the listening socket goes within a tick of the server loop
                        try:
                            await fresh.get(f"{url}/ping")
                        except httpx.ConnectError:
                            break
                        await asyncio.sleep(0.05)
                assert not closing.done()  # still waiting for the stream in flight
                release.set()
                assert [line async for line in lines] == ["last"]
            await asyncio.wait_for(closing, 30)

    asyncio.run(run())


@pytest.mark.slow
def test_edge_proxy_answers_through_serves_proxy_on_the_serve_port(tiny_llama_dir: str,
                                                                   tmp_path) -> None:
    server = start_server(["--edge", "proxy", "--model", tiny_llama_dir, "--device", "cpu",
                           "--max-model-len", "256"], tmp_path / "serve.log")
    try:
        assert [psutil.Process(pid).name() for pid in server.listeners()] == ["ray::ProxyActor"]
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert 1 <= response.json()["usage"]["completion_tokens"] <= 4
    finally:
        server.stop()
    assert server.process.returncode == 0, server.log.read_text()[-3000:]
