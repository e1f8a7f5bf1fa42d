"""The ``Engine`` deployment: each Serve replica is one engine replica and owns its host actors.

A replica places and supervises; it computes nothing. It starts its lead ``HostActor`` (and, for a
multi-host replica, a ``FollowerHost`` per other host) in its own placement group
(``engine_placement.py``), so the hosts share its fate: Serve removes them with the replica, and
restarts a replica whose hosts died or whose engine stopped (``check_health``), placement group and
all. A replica that Serve stops in good order (a scale-down, an update) retires its lead first:
running sequences finish, then its callers' streams end. Nothing that happens to a caller
rebuilds a replica.

Callers (``client.EngineClient``, one per process) place each sequence with a handle whose
``EngineRouter`` picks the replica: ``submit(channel, spec)`` queues it on the lead and returns the
lead's handle, and from then on the caller submits further sequences, streams their tokens, renews
its lease and aborts its sequences at the lead directly (``HostActor.submit`` / ``outputs`` /
``keepalive`` / ``abort``), so tokens never pass through a Serve replica. ``stats``, ``info``,
``drain``, and, for Ray programs, ``generate`` / ``generate_stream`` (one sequence per call) are
here too.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict

from ray import serve

from meshserve.actors.lockstep import check_agreement
from meshserve.actors.messages import (Completion, GenerateSpec, HostError, HostInfo,
                                       RequestRejected)
from meshserve.actors.replica import start_replica
from meshserve.contracts.tokens import TokenDelta
from meshserve.deploy.engine_placement import EnginePlacement
from meshserve.deploy.load import ReplicaGone
from meshserve.deploy.loopback import bind_serve_grpc_to_node_ip
from meshserve.deploy.settings import ServeSettings
from meshserve.logs import configure_process_logging

logger = logging.getLogger("meshserve.engine")
bind_serve_grpc_to_node_ip()

HEALTH_TIMEOUT_S = 10.0  # a lead that cannot answer this fast is as good as gone
# How long a replica that Serve stops lets its running sequences finish (its deployment's
# graceful_shutdown_timeout_s leaves a margin on top), and how fast its lead must say it is
# healthy first: Serve stops a replica that failed its health check the same way.
RETIRE_S = 25.0
RETIRE_HEALTH_S = 2.0


class EngineReplica:
    """One engine replica: its host actors, placed in its own placement group."""

    async def __init__(self, settings: ServeSettings, placement: EnginePlacement) -> None:
        configure_process_logging()
        self.settings = settings
        self.placement = placement
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.group = start_replica(placement.host_slots(), settings.engine,
                                   max_requests=settings.max_queued_requests,
                                   env=settings.host_env(),
                                   reserved_cpus=settings.reserved_cpus)
        settings.lower_priority()  # this process only supervises
        self.lead = self.group.lead
        # The lead answers once every host has loaded (and agreed on the cache).
        lead = await self.lead.info.remote()
        infos = [lead, *await asyncio.gather(*(f.info.remote() for f in self.group.followers))]
        check_agreement(infos)
        self._hosts = infos
        self._watch = asyncio.get_running_loop().create_task(self._watch_lead())

    async def _watch_lead(self) -> None:
        """Leave as soon as the lead host died or its engine stopped: Serve then starts a new
        replica at once (placement group and all), and callers stop choosing this one. One call
        stays pending on the lead for the replica's life; a lead that hangs instead is Serve's
        health check's to find (``check_health``)."""
        import ray

        try:
            reason = await self.lead.stopped.remote()
        except ray.exceptions.RayActorError as exc:
            reason = str(getattr(exc, "cause", exc))
        logger.error("engine replica %s: %s; leaving so that Serve replaces it",
                     self.replica_id, reason)
        os._exit(1)

    async def __del__(self) -> None:
        """Serve is stopping this replica (a scale-down, an update, the application's deletion):
        let its sequences finish for up to ``RETIRE_S``, then end its callers' streams, so that
        they see the replica leave instead of fail. A lead that is failing is left as it is."""
        lead = getattr(self, "lead", None)  # the constructor may not have got that far
        if lead is None:
            return
        try:
            await asyncio.wait_for(lead.health.remote(), RETIRE_HEALTH_S)
            outcome = await lead.retire.remote(RETIRE_S)
        except Exception as exc:  # noqa: BLE001 - failing, hung or gone: its callers see that
            logger.info("engine replica %s stops without retiring: %r", self.replica_id, exc)
            return
        logger.info("engine replica %s retired: %s", self.replica_id, outcome)

    # ------------------------------------------------------------------ callers
    async def submit(self, channel: str, spec: GenerateSpec, replica_id: str | None = None
                     ) -> tuple[str, object, str | None]:
        """Queue one sequence for ``channel`` on the lead; returns (this replica's id, the lead's
        handle, an error message or None). ``replica_id`` is for the caller's router (it pins the
        call to this replica). The lead raises ``RouterOverloaded`` when it holds
        ``max_queued_requests`` sequences, and ``ServerDraining`` after ``drain``."""
        try:
            error = (await self.lead.submit.remote(channel, [spec]))[0]
        except HostError as exc:
            # The engine stopped; this replica leaves at once (_watch_lead). Until Serve
            # notices, say which replica failed, so the caller places the sequence elsewhere.
            raise ReplicaGone(f"engine replica {self.replica_id} failed: "
                              f"{getattr(exc, 'cause', exc)}", self.replica_id) from None
        return self.replica_id, self.lead, error

    async def generate(self, spec: GenerateSpec) -> Completion:
        """Generate one sequence to the end."""
        deltas = [d async for batch in self.generate_stream(spec) for d in batch]
        return Completion.from_deltas(spec.request_id, deltas)

    async def generate_stream(self, spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        """Stream one sequence's deltas (call with ``handle.options(stream=True)``); an invalid
        prompt raises ``RequestRejected``."""
        import ray

        stream = self.lead.stream_spec.options(num_returns="streaming").remote(spec)
        finished = False
        try:
            async for ref in stream:
                yield await ref
            finished = True
        except ValueError as exc:  # the lead refused the prompt
            finished = True
            raise RequestRejected(str(getattr(exc, "cause", exc))) from None
        finally:
            if not finished:  # closed early: cancelling the lead's generator aborts it there
                ray.cancel(stream)

    # ------------------------------------------------------------------ state
    def info(self, replica_id: str | None = None) -> HostInfo:
        return self._hosts[0]

    async def stats(self, replica_id: str | None = None) -> dict:
        """This replica: its id, placement mode ("cpu" or "tpu"), hosts' nodes and processes,
        engine counters and load."""
        engine, load = await asyncio.gather(self.lead.stats.remote(), self.lead.load.remote())
        return {"replica_id": self.replica_id, "placement": self.placement.shape.mode,
                "node_ids": [i.node_id for i in self._hosts],
                "pids": [i.pid for i in self._hosts], "sequences": load["requests"],
                "owed_tokens": sum(load["owed_tokens"].values()), "engine": asdict(engine)}

    async def record_routing_stats(self) -> dict:
        """What every caller's ``EngineRouter`` sees of this replica (Serve polls it every
        ``ROUTING_STATS_PERIOD_S`` where there are several replicas)."""
        return {"owed_tokens": (await self.lead.load.remote())["owed_tokens"]}

    async def check_health(self) -> None:
        """Fails when a host died, the engine stopped or a lockstep step is stuck."""
        await asyncio.wait_for(self.lead.health.remote(), HEALTH_TIMEOUT_S)

    async def drain(self, timeout_s: float, replica_id: str | None = None) -> dict:
        """Take no new sequences; let running ones finish for up to ``timeout_s``, then end the
        rest (their streams get an error); return what happened."""
        return await self.lead.drain.remote(timeout_s)
