"""Ray actors: one host actor per host, replicas of one or more hosts, and their placement.

For Ray programs (batch jobs) the public names are here::

    host = start_host(EngineConfig(model=...))          # one HostActor
    completion = ray.get(host.generate.remote(prompt_token_ids, SamplingParams(max_tokens=32)))
"""

from meshserve.actors.host import (Completion, GenerateSpec, HostActor, HostError, HostInfo,
                                   start_host)
from meshserve.actors.lockstep import FollowerHost
from meshserve.actors.placement import Placement, place_hosts
from meshserve.actors.replica import ReplicaGroup, start_replica, start_replicas

__all__ = ["Completion", "FollowerHost", "GenerateSpec", "HostActor", "HostError", "HostInfo",
           "Placement", "ReplicaGroup", "place_hosts", "start_host", "start_replica",
           "start_replicas"]
