"""The ``Engine`` deployment: each Serve replica is one engine replica, its lead host in-process.

A replica owns one placement group (``engine_placement.py``): it runs the lead host's engine in its
own process (a ``HostActor`` object, stepping in a thread of its own) and starts the followers of a
multi-host replica in the other bundles. Serve restarts a replica whose process dies or whose
``check_health`` fails (the engine failed, or the replica fell out of step), placement group and
all; a replica is never rebuilt for anything that happens to its callers.

Callers (``client.EngineClient``, one per process) speak to it through a handle whose
``EngineRouter`` picks the replica for each sequence:

- ``submit(channel, spec)`` queues a sequence; its deltas go to the caller's ``channel``.
- ``outputs(channel)`` is the caller's one stream from this replica: each item is every delta one
  or more engine steps produced for that caller's sequences.
- ``keepalive(channel)`` renews the caller's lease. A channel unheard of for ``LEASE_S`` belongs
  to a caller that died (Serve does not end a stream whose reader is gone): its sequences are
  aborted and their KV blocks freed.
- ``abort``, ``stats``, ``info``, ``drain`` and, for Ray programs, ``generate`` /
  ``generate_stream`` (one sequence, one call).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict

from ray import serve

from meshserve.actors.host import HostActor
from meshserve.actors.lockstep import FollowerHost, check_agreement
from meshserve.actors.messages import (Completion, GenerateSpec, HostError, HostInfo,
                                       RequestRejected, RouterOverloaded, ServerDraining)
from meshserve.contracts.tokens import TokenDelta
from meshserve.deploy.engine_placement import EnginePlacement
from meshserve.deploy.logs import configure_process_logging
from meshserve.deploy.loopback import bind_serve_grpc_to_node_ip
from meshserve.deploy.settings import ServeSettings

logger = logging.getLogger("meshserve.engine")
bind_serve_grpc_to_node_ip()

LEASE_S = 15.0  # a caller silent this long is gone; EngineClient renews every KEEPALIVE_S
KEEPALIVE_S = 1.0


class EngineReplica:
    """One engine replica: the lead host's engine here, followers in its placement group."""

    def __init__(self, settings: ServeSettings, placement: EnginePlacement) -> None:
        import ray

        configure_process_logging()
        self.settings = settings
        self.placement = placement
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        os.environ.update(placement.lead_env())  # before the engine starts torch_xla
        followers = [ray.remote(FollowerHost).options(**slot.actor_options())
                     .remote(settings.engine, host_index=slot.bundle_index)
                     for slot in placement.follower_slots()]
        self.host = HostActor(settings.engine, followers=followers)
        infos = [self.host.info(), *ray.get([f.info.remote() for f in followers])]
        check_agreement(infos)
        self._info = infos[0]
        self._hosts = infos
        self._leases: dict[str, float] = {}  # channel -> when its caller was last heard of
        self._sweeper: asyncio.Task | None = None
        self._draining = False

    # ------------------------------------------------------------------ callers' channels
    async def submit(self, channel: str, spec: GenerateSpec) -> tuple[str, str | None]:
        """Queue one sequence for ``channel``; returns (this replica's id, an error message or
        None). Raises ``RouterOverloaded`` when this replica holds ``max_queued_requests``."""
        if self._draining:
            raise ServerDraining("the server is shutting down")
        if self.host.num_requests >= self.settings.max_queued_requests:
            raise RouterOverloaded(f"{self.host.num_requests} sequences in flight")
        self._renew(channel)
        error = (await self.host.submit(channel, [spec]))[0]
        return self.replica_id, error

    async def outputs(self, channel: str, replica_id: str | None = None
                      ) -> AsyncIterator[list[TokenDelta]]:
        """The caller's stream of deltas from this replica (``replica_id`` pins the call)."""
        self._renew(channel)
        async for batch in self.host.outputs(channel):
            yield batch

    def keepalive(self, channel: str, replica_id: str | None = None) -> None:
        self._renew(channel)

    def abort(self, request_ids: list[str], replica_id: str | None = None) -> None:
        self.host.abort(request_ids)

    def _renew(self, channel: str) -> None:
        self._leases[channel] = time.monotonic()
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            cutoff = time.monotonic() - LEASE_S
            for channel in [c for c, seen in self._leases.items() if seen < cutoff]:
                del self._leases[channel]
                aborted = self.host.close_channel(channel)
                if aborted:
                    logger.warning("caller %s went silent: aborted its %d sequences", channel,
                                   aborted)

    # ------------------------------------------------------------------ Ray programs
    async def generate(self, spec: GenerateSpec) -> Completion:
        """Generate one sequence to the end."""
        deltas = [d async for batch in self.generate_stream(spec) for d in batch]
        return Completion.from_deltas(spec.request_id, deltas)

    async def generate_stream(self, spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        """Stream one sequence's deltas (call with ``handle.options(stream=True)``); an invalid
        prompt raises ``RequestRejected``."""
        if self._draining:
            raise ServerDraining("the server is shutting down")
        try:
            async for batch in self.host.stream_spec(spec):
                yield batch
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None

    # ------------------------------------------------------------------ state
    def info(self, replica_id: str | None = None) -> HostInfo:
        return self._info

    def stats(self, replica_id: str | None = None) -> dict:
        """This replica: its id, placement mode ("cpu" or "tpu"), hosts' nodes and processes,
        engine counters and load."""
        return {"replica_id": self.replica_id, "placement": self.placement.shape.mode,
                "node_ids": [i.node_id for i in self._hosts],
                "pids": [i.pid for i in self._hosts], "sequences": self.host.num_requests,
                "owed_tokens": sum(self.host.owed_tokens().values()),
                "engine": asdict(self.host.stats())}

    def record_routing_stats(self) -> dict:
        """What every caller's ``EngineRouter`` sees of this replica (Serve polls it)."""
        return {"owed_tokens": self.host.owed_tokens()}

    def check_health(self) -> None:
        failure = self.host.failure
        if failure is not None:
            raise HostError(failure)

    async def drain(self, timeout_s: float, replica_id: str | None = None) -> dict:
        """Take no new sequences; let running ones finish for up to ``timeout_s``, then end the
        rest (their streams get an error); return what happened."""
        self._draining = True
        running = self.host.num_requests
        deadline = time.monotonic() + timeout_s
        while self.host.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cancelled = self.host.cancel_all(ServerDraining("the server is shutting down"))
        return {"in_flight": running, "finished": running - cancelled, "cancelled": cancelled}
