"""Replicas as Ray actors: groups of host actors placed on distinct hosts, for Ray programs.

A replica is one ``HostActor`` (the lead, host 0) plus, when it spans several hosts, one
``FollowerHost`` per other host that runs the lead's steps in lockstep (``lockstep.py``). Only the
lead takes requests and yields tokens. Where the hosts go is ``placement.py``'s business. (The
Serve application runs its lead inside each ``Engine`` replica instead; see
``meshserve.deploy.engine``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import ray

from meshserve.actors.host import HostActor
from meshserve.actors.lockstep import FollowerHost, check_agreement
from meshserve.actors.messages import HostInfo
from meshserve.actors.placement import HostSlot, Placement, place_hosts
from meshserve.config import EngineConfig, PlacementConfig


class ReplicaGroup:
    """The host actors of one replica; the lead takes requests and yields tokens."""

    def __init__(self, lead, followers: Sequence = ()) -> None:
        self.lead = lead
        self.followers = list(followers)
        self.hosts = [lead, *self.followers]
        self.node_ids: list[str] = []
        self.pids: list[int] = []

    async def ready(self) -> HostInfo:
        """Wait until every host has loaded; check they agree; return the lead's info."""
        # The lead first: it answers once every host has allocated the agreed cache.
        lead = await self.lead.info.remote()
        infos: list[HostInfo] = [lead, *await asyncio.gather(
            *(h.info.remote() for h in self.followers))]
        check_agreement(infos)
        self.node_ids = [info.node_id for info in infos]
        self.pids = [info.pid for info in infos]
        return infos[0]

    def kill(self) -> None:
        for host in self.hosts:
            ray.kill(host)


def start_replica(slots: Sequence[HostSlot], config: EngineConfig, *,
                  follower_class: type[FollowerHost] = FollowerHost,
                  max_requests: int | None = None,
                  env: dict[str, str] | None = None, reserved_cpus: int = 0) -> ReplicaGroup:
    """Start one replica's actors in its slots (lead first; anything with ``actor_options()``);
    returns before they have loaded. ``max_requests`` goes to the lead (``HostActor``), ``env``
    into every host's environment, ``reserved_cpus`` to every host (``actors/cpus.py``).

    Every host starts at once: on a TPU slice the runtime connects all of a slice's hosts when it
    starts, so none may wait for another. ``follower_class`` lets tests inject a faulty follower.
    """
    def options(slot) -> dict:
        opts = slot.actor_options()
        if env:
            runtime_env = opts.get("runtime_env", {})
            opts["runtime_env"] = {**runtime_env,
                                   "env_vars": {**runtime_env.get("env_vars", {}), **env}}
        return opts

    followers = [ray.remote(follower_class).options(**options(slot))
                 .remote(config, host_index=h, reserved_cpus=reserved_cpus)
                 for h, slot in enumerate(slots[1:], start=1)]
    lead = ray.remote(HostActor).options(**options(slots[0])).remote(
        config, host_index=0, reserved_cpus=reserved_cpus, followers=followers,
        max_requests=max_requests)
    return ReplicaGroup(lead, followers)


def start_replicas(engine: EngineConfig,
                   placement: PlacementConfig) -> tuple[Placement, list[ReplicaGroup]]:
    """Place and start every replica of a deployment; returns before the engines have loaded."""
    placed = place_hosts(placement.num_replicas, placement.hosts_per_replica,
                         placement.host_num_cpus)
    return placed, [start_replica(slots, engine) for slots in placed.replicas]
