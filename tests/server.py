"""Start ``meshserve serve`` the way the README does, as a child process, and stop it cleanly."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

READY_TIMEOUT_S = 300


# The server binds its port half a minute after the test picks it. A port from the kernel's
# ephemeral range (what binding port 0 gives) can be taken meanwhile by any socket the kernel
# numbers itself, Ray's gRPC servers among them, and Ray gives its workers 10002-19999; ports
# between the two are handed out by nobody but the tests.
FIRST_TEST_PORT = 20000


def free_port() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        ephemeral_start = int(f.read().split()[0])
    for port in random.sample(range(FIRST_TEST_PORT, ephemeral_start), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FIRST_TEST_PORT}-{ephemeral_start - 1}")


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples without labels, by name."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Wait until every engine replica answers, no sequence runs and every KV block is free;
        return the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["meshserve_healthy_replicas"] == m["meshserve_replicas"]
                    and m["meshserve_kv_cache_total_blocks"] > 0
                    and m["meshserve_num_requests_running"] == 0
                    and m["meshserve_num_requests_waiting"] == 0
                    and m["meshserve_kv_cache_free_blocks"] == m["meshserve_kv_cache_total_blocks"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def socket_owners(self) -> list[int | None]:
        """The owner of every socket listening on the server's port on 127.0.0.1 (the ingress
        replicas, or Serve's proxy with ``--edge proxy``; no other process takes a test's port).
        None for a socket no process owns in /proc: a killed process turns zombie as its main
        thread exits, but its files close only once its last thread has (a Ray worker has
        dozens), and until then its socket still listens and the kernel still queues
        connections on it."""
        return [c.pid for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr == ("127.0.0.1", self.port)]

    def listeners(self) -> list[int]:
        """The PIDs of the processes listening on the server's port (``socket_owners``)."""
        return sorted({pid for pid in self.socket_owners() if pid is not None})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def processes(server_pid: int, title: str) -> list[int]:
    """The PIDs under the server whose command line names ``title``: ``ray::HostActor`` (lead
    hosts), ``ServeReplica:meshserve:OpenAIIngress`` (ingress replicas)..."""
    found = []
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            if title in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(found)


HOSTS = "ray::HostActor"
INGRESS = "ServeReplica:meshserve:OpenAIIngress"


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """Run ``meshserve serve ARGS`` on a free loopback port and wait until /health says 200."""
    port = free_port()
    command = [sys.executable, "-m", "meshserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *args]
    out = open(log, "w")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"meshserve serve exited early:\n{log.read_text()[-4000:]}")
        if "meshserve: ready" in log.read_text():
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"meshserve serve did not become ready:\n{log.read_text()[-4000:]}")
