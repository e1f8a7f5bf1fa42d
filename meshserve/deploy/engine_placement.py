"""Where Serve puts an engine replica and its hosts: the ``Engine`` deployment's placement options,
and, inside a replica, where its follower hosts go.

Each engine replica is one Serve replica that owns one placement group with one bundle per host,
as ``meshserve.actors.placement.replica_shape`` describes it (CPU bundles, ``STRICT_SPREAD`` where
the cluster allows; on TPU whole-host bundles, bundle *h* on TPU worker *h*). Serve reserves the
group when it starts the replica, places the replica (the lead host) in bundle 0, and removes the
group, followers and all, when the replica stops or fails its health check. The followers are
started by the replica itself in bundles 1..H-1 (``follower_slots``). A one-host CPU replica needs
no group; Serve then keeps replicas on distinct nodes when there are nodes enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.actors.placement import HostSlot, ReplicaShape, alive_nodes, replica_shape
from meshserve.config import PlacementConfig


@dataclass(frozen=True)
class EnginePlacement:
    """The placement half of the ``Engine`` deployment's options, decided once from the cluster."""

    shape: ReplicaShape
    num_replicas: int

    def deployment_options(self) -> dict[str, Any]:
        """``serve.deployment`` keyword arguments that place one replica (its lead in bundle 0)."""
        shape = self.shape
        lead: dict[str, Any] = {"num_cpus": shape.host_num_cpus}
        chips = {k: v for k, v in shape.bundle_resources.items() if k != "CPU"}
        if chips:
            lead["resources"] = chips
        # What is known before placement (the rest in lead_env). On CPU hosts torch_xla's default
        # device, named so that it does not warn about choosing it.
        env = shape.host_env(0, []) if shape.tpu is not None else {"PJRT_DEVICE": "CPU"}
        if env:
            lead["runtime_env"] = {"env_vars": env}
        if shape.hosts == 1 and shape.tpu is None:
            if shape.spread and self.num_replicas > 1:
                return {"ray_actor_options": lead, "max_replicas_per_node": 1}
            return {"ray_actor_options": lead}
        options = {"ray_actor_options": lead, "placement_group_bundles": shape.bundles,
                   "placement_group_strategy": shape.strategy}
        if shape.label_selectors is not None:
            options["placement_group_bundle_label_selector"] = shape.label_selectors
        return options

    def _slots(self) -> tuple[HostSlot, ...]:
        import ray

        from meshserve.actors.placement import slots_in

        return slots_in(ray.util.get_current_placement_group(), self.shape)

    def follower_slots(self) -> tuple[HostSlot, ...]:
        """Inside a replica: where hosts 1..H-1 go (bundles of the replica's own group)."""
        return self._slots()[1:] if self.shape.hosts > 1 else ()

    def lead_env(self) -> dict[str, str]:
        """Inside a replica: the lead's runtime variables, set before the engine starts."""
        return self._slots()[0].env_vars if self.shape.hosts > 1 else {}


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
