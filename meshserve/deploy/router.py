"""The router: a Ray Serve deployment in front of the host actors.

It owns the replicas (a lead ``HostActor``, plus ``FollowerHost`` s when a replica spans several
hosts), picks one per sequence by load with prefix-cache affinity, and turns each replica's single
output channel back into one stream per sequence. It speaks token ids; text is the ingress's
business.

Ray programs reach it through a deployment handle::

    router = serve.get_deployment_handle("Router", app_name="meshserve")
    completion = await router.generate.remote(spec)                  # a Completion
    async for batch in router.options(stream=True).generate_stream.remote(spec):
        ...                                                          # lists of TokenDelta
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from ray import serve

from meshserve.actors.channel import next_batch
from meshserve.actors.messages import (Completion, GenerateSpec, HostInfo, RequestRejected,
                                      RouterOverloaded)
from meshserve.actors.replica import ReplicaGroup, start_replica, start_replicas
from meshserve.contracts.tokens import TokenDelta
from meshserve.deploy.loopback import bind_serve_grpc_to_node_ip
from meshserve.deploy.settings import ServeSettings

logger = logging.getLogger("meshserve.router")
bind_serve_grpc_to_node_ip()

AFFINITY_BLOCKS = 4  # prompts sharing this many leading KV blocks are steered together
AFFINITY_SLACK = 2.0  # ...unless that replica carries more than this times the lightest load


class ReplicaFailed(RuntimeError):
    """The replica serving a sequence died; a sequence that had produced nothing is retried."""


@dataclass
class ReplicaState:
    group: ReplicaGroup
    index: int
    # Per sequence, batches of its deltas (or a failure), as actors/channel.py reads them.
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    load_tokens: int = 0  # tokens still owed by sequences in flight
    healthy: bool = True
    pump: asyncio.Task | None = None
    restarts: int = 0


class Router:
    """Routes sequences to replicas and streams their tokens back."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.channel = f"router-{uuid.uuid4().hex[:8]}"
        # The placement groups share this actor's fate: they go (with the hosts) when it does.
        self.placement, groups = start_replicas(settings.engine, settings.placement)
        self.replicas = [ReplicaState(group, i) for i, group in enumerate(groups)]
        self._affinity: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica index
        self._turn = itertools.count()  # rotates ties, so idle replicas take turns
        self._in_flight = 0
        self._info: HostInfo | None = None
        self._ready = asyncio.Event()
        self._warmup: asyncio.Task | None = None

    # ------------------------------------------------------------------ readiness
    async def ready(self) -> bool:
        """True once every replica has loaded and warmed up (never blocks)."""
        if self._warmup is None:
            self._warmup = asyncio.get_running_loop().create_task(self._wait_ready())
        if self._warmup.done() and self._warmup.exception() is not None:
            raise self._warmup.exception()
        return self._ready.is_set()

    async def _wait_ready(self) -> None:
        infos = await asyncio.gather(*(r.group.ready() for r in self.replicas))
        self._info = infos[0]
        for replica in self.replicas:
            replica.pump = asyncio.get_running_loop().create_task(self._pump(replica))
        self._ready.set()
        logger.info("router ready: %d replicas", len(self.replicas))

    async def info(self) -> HostInfo:
        await self.ready()
        await self._ready.wait()
        assert self._info is not None
        return self._info

    async def stats(self) -> dict:
        """Router counters and, per replica in order, its hosts' nodes, load and engine stats."""
        async def engine_stats(replica: ReplicaState) -> dict | None:
            if not replica.healthy:
                return None
            try:
                return asdict(await replica.group.stats())
            except Exception:  # noqa: BLE001 - died since; its pump marks it unhealthy
                return None

        engines = await asyncio.gather(*(engine_stats(r) for r in self.replicas))
        return {
            "in_flight": self._in_flight,
            "replicas": len(self.replicas),
            "healthy_replicas": sum(r.healthy for r in self.replicas),
            "placement": self.placement.mode,
            "engines": [e for e in engines if e is not None],
            "replica_states": [
                {"healthy": r.healthy, "node_ids": r.group.node_ids, "load_tokens": r.load_tokens,
                 "sequences": len(r.streams), "restarts": r.restarts, "pids": r.group.pids,
                 "engine": e}
                for r, e in zip(self.replicas, engines)],
        }

    # ------------------------------------------------------------------ generation
    async def generate(self, spec: GenerateSpec) -> Completion:
        """Generate one sequence to the end."""
        deltas = [d async for batch in self.generate_stream(spec) for d in batch]
        return Completion.from_deltas(spec.request_id, deltas)

    async def generate_stream(self, spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        """Stream the token deltas of one sequence; the last one carries a finish reason.

        If its replica dies before the sequence produced a token, it is retried on another
        healthy replica; after that, the failure is raised to the caller.
        """
        await self.info()
        if self._in_flight >= self.settings.max_queued_requests:
            raise RouterOverloaded(f"{self._in_flight} requests in flight")
        self._in_flight += 1
        try:
            for attempt in range(len(self.replicas)):
                produced = False
                try:
                    async for batch in self._run_on(self._pick(spec), spec):
                        produced = True
                        yield batch
                    return
                except ReplicaFailed:
                    if produced or attempt == len(self.replicas) - 1:
                        raise
                    logger.warning("retrying %s on another replica", spec.request_id)
        finally:
            self._in_flight -= 1

    async def _run_on(self, replica: ReplicaState,
                      spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        cost = len(spec.prompt_token_ids) + spec.params.max_tokens
        stream: asyncio.Queue = asyncio.Queue()
        replica.streams[spec.request_id] = stream
        replica.load_tokens += cost
        finished = False
        try:
            try:
                errors = await replica.group.submit(self.channel, [spec])
            except Exception as exc:  # noqa: BLE001 - the lead is gone (RayActorError & co.)
                raise ReplicaFailed(f"replica {replica.index} is unavailable: {exc}") from None
            if errors[0] is not None:
                raise RequestRejected(errors[0])
            while not finished:
                batch = await next_batch(stream)
                finished = batch[-1].finish_reason is not None
                yield batch
        finally:
            replica.streams.pop(spec.request_id, None)
            replica.load_tokens -= cost
            if not finished and replica.healthy:  # client went away or an error: free blocks now
                replica.group.abort([spec.request_id])

    async def abort(self, request_ids: list[str]) -> None:
        for replica in self.replicas:
            owned = [r for r in request_ids if r in replica.streams]
            if owned:
                replica.group.abort(owned)

    def _pick(self, spec: GenerateSpec) -> ReplicaState:
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise RuntimeError("no healthy replica")
        turn, count = next(self._turn), len(self.replicas)
        lightest = min(healthy, key=lambda r: (r.load_tokens, (r.index - turn) % count))
        key = self._prefix_key(spec.prompt_token_ids)
        if key is None:
            return lightest
        index = self._affinity.get(key)
        if index is not None:
            holder = self.replicas[index]
            if holder.healthy and holder.load_tokens <= AFFINITY_SLACK * lightest.load_tokens + \
                    len(spec.prompt_token_ids) + spec.params.max_tokens:
                self._affinity.move_to_end(key)
                return holder
        self._affinity[key] = lightest.index
        if len(self._affinity) > 4096:
            self._affinity.popitem(last=False)
        return lightest

    def _prefix_key(self, tokens: tuple[int, ...]) -> int | None:
        span = AFFINITY_BLOCKS * self.settings.engine.cache.block_size
        return hash(tokens[:span]) if len(tokens) > span else None

    async def _pump(self, replica: ReplicaState) -> None:
        """Fan a replica's output channel out to the per-sequence streams."""
        try:
            async for batch in replica.group.outputs(self.channel):
                by_sequence: dict[str, list[TokenDelta]] = {}
                for delta in batch:
                    by_sequence.setdefault(delta.request_id, []).append(delta)
                for request_id, deltas in by_sequence.items():
                    stream = replica.streams.get(request_id)
                    if stream is not None:
                        stream.put_nowait(deltas)
            raise ReplicaFailed("its output channel closed")
        except Exception as exc:  # noqa: BLE001 - the replica died: fail its sequences, restart
            logger.error("replica %d failed: %r; restarting it", replica.index, exc)
            replica.healthy = False
            failure = ReplicaFailed(f"replica {replica.index} failed: {exc}")
            for stream in replica.streams.values():
                stream.put_nowait([failure])
            asyncio.get_running_loop().create_task(self._restart(replica))

    async def _restart(self, replica: ReplicaState) -> None:
        """Replace a failed replica's actors in the same placement slots, then serve again."""
        replica.group.kill()
        slots = self.placement.replicas[replica.index]
        while True:
            group = start_replica(slots, self.settings.engine)
            try:
                await group.ready()
                break
            except Exception as exc:  # noqa: BLE001 - keep trying; the replica stays out of service
                logger.error("restarting replica %d failed: %r", replica.index, exc)
                group.kill()
                await asyncio.sleep(1.0)
        replica.group = group
        replica.restarts += 1
        replica.healthy = True
        replica.pump = asyncio.get_running_loop().create_task(self._pump(replica))
        logger.info("replica %d restarted (%d restarts)", replica.index, replica.restarts)


RouterDeployment = serve.deployment(
    Router, name="Router", num_replicas=1, ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=100_000, graceful_shutdown_wait_loop_s=0.5,
    graceful_shutdown_timeout_s=5)
