"""Replicas: groups of host actors placed on distinct hosts, and how a router talks to one.

A replica is one or more ``HostActor`` s. With one host, that actor serves on its own. Placement
goes through a Ray placement group: one bundle per host, spread so that no two hosts of the
deployment share a node when the cluster has enough of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshserve.actors.host import GenerateSpec, HostActor, HostInfo
from meshserve.engine.engine import EngineStats, TokenDelta


class ReplicaGroup:
    """The host actors of one replica; the lead (host 0) takes requests and yields tokens."""

    def __init__(self, hosts: list) -> None:
        self.hosts = hosts
        self.lead = hosts[0]
        self.node_ids: list[str] = []

    async def ready(self) -> HostInfo:
        infos: list[HostInfo] = await asyncio.gather(*(h.info.remote() for h in self.hosts))
        self.node_ids = [info.node_id for info in infos]
        return infos[0]

    async def submit(self, channel: str, specs: list[GenerateSpec]) -> list[str | None]:
        return await self.lead.submit.remote(channel, specs)

    def abort(self, request_ids: list[str]) -> None:
        self.lead.abort.remote(request_ids)

    async def stats(self) -> EngineStats:
        return await self.lead.stats.remote()

    async def outputs(self, channel: str) -> AsyncIterator[list[TokenDelta]]:
        stream = self.lead.outputs.options(num_returns="streaming").remote(channel)
        async for ref in stream:
            yield await ref


def start_replicas(settings) -> list[ReplicaGroup]:
    """Create every host actor of a deployment (``ServeSettings``) and group them by replica."""
    hosts_per_replica = settings.hosts_per_replica
    if hosts_per_replica != 1:
        raise NotImplementedError("hosts_per_replica > 1 needs the multi-host replica support")
    total = settings.num_replicas * hosts_per_replica
    group = placement_group([{"CPU": settings.host_num_cpus}] * total, strategy="SPREAD",
                            name=f"meshserve-hosts-{id(settings):x}")
    engine_config = settings.engine_config()
    actor = ray.remote(HostActor)
    replicas = []
    for r in range(settings.num_replicas):
        hosts = [
            actor.options(
                num_cpus=settings.host_num_cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=r * hosts_per_replica + h),
            ).remote(engine_config, host_index=h)
            for h in range(hosts_per_replica)
        ]
        replicas.append(ReplicaGroup(hosts))
    return replicas
