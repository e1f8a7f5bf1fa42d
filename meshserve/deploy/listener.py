"""``IngressListener``: an ingress replica answers HTTP itself, with no proxy in between.

Through Ray Serve's proxy every request, and every chunk of every stream, crosses one more
process: the proxy parses HTTP, hands the ASGI messages to an ingress replica and relays each
chunk back (on 2 cores that costs the engine about a tenth of its throughput; bench/README.md).
With a listener each ingress replica accepts connections on the serve port itself. Every replica
on a node binds the same ``host:port`` with ``SO_REUSEPORT``, and the kernel spreads new
connections over their sockets; a replica that dies takes its socket with it, so connections go
to the others until Serve has started its successor, which binds again. Connections the kernel
had queued on the dead replica's socket and not yet handed to it are reset as the socket closes,
which is when the process's last thread has exited (0.1-0.7 s after a SIGKILL on a 2-core
machine): a client sees a failed connection, as from any server that dies, and may retry.

What the proxy did that this does not: Serve's request accounting (``max_ongoing_requests``,
autoscaling on ongoing requests) never sees these requests, so the ingress runs a fixed number of
replicas; and its ``/-/healthz`` and ``/-/routes`` are not served (``/health`` is).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

logger = logging.getLogger("meshserve.ingress")


def listening_socket(host: str, port: int, *, shared: bool) -> socket.socket:
    """A TCP socket bound to ``host:port``; ``shared``: with ``SO_REUSEPORT``, so that every
    ingress replica on the node can bind the same address. Raises ``OSError`` naming the address
    when it is taken (by anything that did not set ``SO_REUSEPORT`` too)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class IngressListener:
    """Serve ``app`` (the ingress's ASGI app) on ``host:port`` from the running event loop, the
    replica's own: routes run exactly as they do behind the proxy."""

    def __init__(self, app, host: str, port: int, shutdown_timeout_s: float) -> None:
        self.address = f"{host}:{port}"
        self.socket = listening_socket(host, port, shared=True)
        config = uvicorn.Config(
            app, lifespan="off",  # Serve has run the app's lifespan already
            log_config=None,  # leave the replica's logging as meshserve set it
            access_log=False, proxy_headers=False, ws="none",
            timeout_graceful_shutdown=shutdown_timeout_s)
        self.server = uvicorn.Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve([self.socket]))
        self.task.add_done_callback(self._stopped)

    def _stopped(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("HTTP listener on %s stopped: %r", self.address, task.exception())

    async def close(self) -> None:
        """Stop accepting, let responses in flight finish (up to the shutdown timeout), close."""
        self.server.should_exit = True
        await asyncio.wait([self.task])
