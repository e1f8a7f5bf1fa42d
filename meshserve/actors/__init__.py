"""Ray actors: one host actor per host, replicas of one or more hosts, and their placement.

For Ray programs (batch jobs) the public names are here::

    host = start_host(EngineConfig(model=...))          # one HostActor
    completion = ray.get(host.generate.remote(prompt_token_ids, SamplingParams(max_tokens=32)))

Modules: ``messages`` (what routers and hosts send each other), ``engine_host`` (what every host
does), ``cpus`` (the CPUs its engine computes on), ``host`` (the lead ``HostActor``), ``lockstep``
(followers of a multi-host replica), ``channel`` (reading an output stream), ``placement`` and
``replica``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshserve.actors.host import HostActor, start_host
    from meshserve.actors.lockstep import FollowerHost
    from meshserve.actors.messages import (Completion, GenerateSpec, HostError, HostInfo,
                                           RequestRejected, RouterOverloaded)
    from meshserve.actors.placement import Placement, place_hosts
    from meshserve.actors.replica import ReplicaGroup, start_replica, start_replicas

# Resolved on first use: the wire types in ``messages`` must stay importable without loading Ray,
# torch and the engine that the actors themselves need.
_LAZY = {
    **dict.fromkeys(("Completion", "GenerateSpec", "HostError", "HostInfo", "RequestRejected",
                     "RouterOverloaded"), "meshserve.actors.messages"),
    **dict.fromkeys(("HostActor", "start_host"), "meshserve.actors.host"),
    "FollowerHost": "meshserve.actors.lockstep",
    **dict.fromkeys(("Placement", "place_hosts"), "meshserve.actors.placement"),
    **dict.fromkeys(("ReplicaGroup", "start_replica", "start_replicas"),
                    "meshserve.actors.replica"),
}

__all__ = ["Completion", "FollowerHost", "GenerateSpec", "HostActor", "HostError", "HostInfo",
           "Placement", "ReplicaGroup", "RequestRejected", "RouterOverloaded", "place_hosts",
           "start_host", "start_replica", "start_replicas"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshserve.actors' has no attribute {name!r}")
