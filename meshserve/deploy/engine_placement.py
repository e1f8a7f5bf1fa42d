"""Where Serve puts an engine replica and its hosts: the ``Engine`` deployment's placement options,
and, inside a replica, where each of its host actors goes.

An engine replica is a Serve replica (a light process: it places and supervises) that owns its host
actors: the lead ``HostActor`` and, for a multi-host replica, a ``FollowerHost`` per other host.
Its placement group has one bundle per host, as ``meshserve.actors.placement.replica_shape``
describes it (CPU bundles, ``STRICT_SPREAD`` where the cluster allows; on TPU whole-host bundles,
bundle *h* on TPU worker *h*). Serve reserves the group when it starts the replica, places the
replica itself (it reserves no CPU) in bundle 0 next to its lead host, and removes the group, hosts
and all, when the replica stops or fails its health check. A one-host CPU replica needs no group:
its host goes to the replica's node, and Serve keeps such replicas on distinct nodes when there are
nodes enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.actors.placement import ReplicaShape, alive_nodes, replica_shape
from meshserve.config import PlacementConfig

# The replica process computes nothing; on CPU hosts this names torch_xla's default device, so
# that the hosts do not warn about choosing it.
CPU_HOST_ENV = {"PJRT_DEVICE": "CPU"}


@dataclass(frozen=True)
class NodeSlot:
    """Where the one host of a one-host CPU replica goes: next to the replica, if it fits."""

    node_id: str
    num_cpus: float

    def actor_options(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"num_cpus": self.num_cpus, "runtime_env": {"env_vars": CPU_HOST_ENV},
                "scheduling_strategy": NodeAffinitySchedulingStrategy(self.node_id, soft=True)}


@dataclass(frozen=True)
class EnginePlacement:
    """The placement half of the ``Engine`` deployment's options, decided once from the cluster."""

    shape: ReplicaShape
    num_replicas: int

    @property
    def grouped(self) -> bool:
        return self.shape.hosts > 1 or self.shape.tpu is not None

    def deployment_options(self) -> dict[str, Any]:
        """``serve.deployment`` keyword arguments that place one replica."""
        replica = {"num_cpus": 0}
        if not self.grouped:
            if self.shape.spread and self.num_replicas > 1:
                return {"ray_actor_options": replica, "max_replicas_per_node": 1}
            return {"ray_actor_options": replica}
        options = {"ray_actor_options": replica, "placement_group_bundles": self.shape.bundles,
                   "placement_group_strategy": self.shape.strategy}
        if self.shape.label_selectors is not None:
            options["placement_group_bundle_label_selector"] = self.shape.label_selectors
        return options

    def host_slots(self) -> tuple:
        """Inside a replica: where its hosts go, lead first (each has ``actor_options()``)."""
        import ray

        if not self.grouped:
            return (NodeSlot(ray.get_runtime_context().get_node_id(), self.shape.host_num_cpus),)
        from meshserve.actors.placement import slots_in

        return slots_in(ray.util.get_current_placement_group(), self.shape)


def engine_placement(config: PlacementConfig) -> EnginePlacement:
    """Decide the engine replicas' placement from what the connected cluster advertises.

    Without a Ray connection (an application built before ``ray.init``) nothing is known about
    the cluster, and replicas are placed as on a single CPU machine.
    """
    import ray

    nodes = alive_nodes() if ray.is_initialized() else []
    shape = replica_shape(nodes, config.hosts_per_replica, config.host_num_cpus,
                          num_replicas=config.num_replicas)
    if shape.needs_slice_reservation and config.num_replicas > 1:
        # Bundles alone cannot keep every host of a replica on one slice once there are several.
        raise ValueError(
            f"num_replicas: serving {config.num_replicas} multi-host TPU slices from one "
            "deployment is not supported yet; deploy one application per slice")
    return EnginePlacement(shape, config.num_replicas)
