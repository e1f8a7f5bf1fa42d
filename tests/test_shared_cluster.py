"""``meshserve serve --address`` on a cluster it shares: another Serve application there keeps
serving while meshserve runs and after it stops; only meshserve's application leaves with it, in
good order (its engine replica retires: its caller sees it leave, not fail). ``--edge proxy`` on
a cluster whose Serve runs no proxy is refused before anything loads."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from ray import serve

from tests.local_cluster import local_cluster
from tests.server import start_server

pytestmark = pytest.mark.slow


def test_stopping_takes_only_meshserve_off_a_shared_cluster(tiny_llama_dir: str,
                                                            tmp_path) -> None:
    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Neighbour:  # defined here, so that Ray ships it by value
        def __call__(self) -> str:
            return "still here"

    with local_cluster(head_cpus=2) as cluster:
        serve.start(proxy_location="Disabled")
        neighbour = serve.run(Neighbour.bind(), name="neighbour", route_prefix=None)
        try:
            # Serve here runs no proxy, and would keep it so: --edge proxy is refused up front,
            # before any model loads, and leaves the cluster's Serve as it was.
            refused = subprocess.run(
                [sys.executable, "-m", "meshserve.cli", "serve", "--address", cluster.address,
                 "--edge", "proxy", "--model", tiny_llama_dir, "--device", "cpu"],
                capture_output=True, text=True, timeout=120)
            assert refused.returncode == 2, refused.stderr[-3000:]
            assert ("meshserve serve: --edge proxy: Serve on this cluster runs no HTTP proxy"
                    in refused.stderr), refused.stderr[-3000:]
            assert "loading" not in refused.stdout, refused.stdout
            assert set(serve.status().applications) == {"neighbour"}
            assert neighbour.remote().result(timeout_s=60) == "still here"
            server = start_server(["--address", cluster.address, "--model", tiny_llama_dir,
                                   "--device", "cpu", "--max-model-len", "256"],
                                  tmp_path / "serve.log")
            try:
                body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}
                response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
                assert response.status_code == 200, response.text
                assert set(serve.status().applications) == {"neighbour", "meshserve"}
            finally:
                server.stop()
            text = server.log.read_text()
            assert server.process.returncode == 0, text[-3000:]
            # The engine replica retired: its caller saw it leave, not fail.
            assert "ERROR" not in text, text[-3000:]
            # The port is meshserve's listener's, not Serve's proxy's (Disabled here, on 8000).
            assert "HTTP config" not in text, text[-3000:]
            assert set(serve.status().applications) == {"neighbour"}
            assert neighbour.remote().result(timeout_s=60) == "still here"
        finally:
            serve.shutdown()
