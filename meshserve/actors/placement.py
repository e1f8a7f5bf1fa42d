"""Where host actors go: one placement-group bundle per host, no two hosts of a replica on a node.

Two modes, chosen from what the cluster advertises:

- TPU: some node advertises the ``TPU`` resource (Ray does so on TPU VMs and GKE TPU pods, from
  ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``, ``TPU_NAME`` and ``TPU_WORKER_ID``). Each replica
  takes one whole slice through Ray's own ``ray.util.tpu.slice_placement_group``: it reserves the
  slice through its ``TPU-<pod>-head`` resource and gang-schedules one ``{"TPU": chips_per_host}``
  bundle per host of that slice. Bundle ``h`` is pinned to the node labelled
  ``ray.io/tpu-worker-id=h``, so host 0, the lead, sits on the node holding ``TPU-<pod>-head``.
- CPU: one ``{"CPU": host_num_cpus}`` bundle per host in one placement group, ``STRICT_SPREAD``
  when the cluster has a node for every host, else ``SPREAD`` (a single development machine).

On TPU each host also gets the TPU runtime environment for its worker index (``HostSlot.env_vars``,
set through the actor's ``runtime_env`` so it is in place before torch_xla starts):

- ``TPU_WORKER_ID``: the host's index in the slice; libtpu uses it as its process id.
- ``TPU_WORKER_HOSTNAMES``: every host's address in worker order; libtpu connects the slice's
  hosts through it. GKE's TPU webhook sets both for a pod, but to the pod's own view; setting them
  from the placement keeps them true to where the actors actually run.

``TPU_PROCESS_BOUNDS``, ``TPU_CHIPS_PER_PROCESS_BOUNDS`` and ``TPU_VISIBLE_CHIPS`` only matter
when several processes share one host's chips; here one actor per host owns all of them (Ray itself
sets ``TPU_VISIBLE_CHIPS`` from the actor's ``TPU`` request), so they are left alone. On CPU
machines that simulate a slice these variables are inert.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger("meshserve.placement")

# Ray's TPU node labels (ray._raylet.RAY_NODE_TPU_*_KEY); public names in Ray's docs.
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"

PLACEMENT_TIMEOUT_S = 300.0  # an autoscaling cluster may need minutes to add nodes


@dataclass(frozen=True)
class HostSlot:
    """Where one host actor goes and what it reserves there."""

    placement_group: PlacementGroup
    bundle_index: int
    num_cpus: float
    resources: dict[str, float] = field(default_factory=dict)  # {"TPU": chips} on a TPU host
    env_vars: dict[str, str] = field(default_factory=dict)  # the TPU runtime environment

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "resources": self.resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.bundle_index),
        }
        if self.env_vars:
            options["runtime_env"] = {"env_vars": self.env_vars}
        return options


@dataclass(frozen=True)
class TpuSliceShape:
    """The shape of the cluster's TPU slices, read from the labels Ray puts on TPU nodes."""

    topology: str  # e.g. "2x2x2"
    accelerator_version: str  # e.g. "v4", "v5litepod", "v6e"
    chips_per_host: int

    @property
    def num_hosts(self) -> int:
        chips = math.prod(int(d) for d in self.topology.split("x"))
        return max(1, chips // self.chips_per_host)


@dataclass(frozen=True)
class Placement:
    """Every replica's host slots (lead first) and the placement groups that hold them."""

    mode: str  # "tpu" or "cpu"
    replicas: tuple[tuple[HostSlot, ...], ...]
    groups: tuple[PlacementGroup, ...]

    def release(self) -> None:
        """Free the reservations (actors in them die). A creator's groups also go when it dies."""
        for group in self.groups:
            remove_placement_group(group)


def place_hosts(num_replicas: int, hosts_per_replica: int, host_num_cpus: float) -> Placement:
    """Reserve one bundle per host for every replica; blocks until Ray has placed them."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    shape = tpu_slice_shape(nodes)
    if shape is None:
        return _place_on_cpus(nodes, num_replicas, hosts_per_replica, host_num_cpus)
    return _place_on_tpu_slices(shape, nodes, num_replicas, hosts_per_replica, host_num_cpus)


def tpu_slice_shape(nodes: list[dict]) -> TpuSliceShape | None:
    """The cluster's TPU slice shape, or None when no node advertises TPU."""
    shapes = set()
    for node in nodes:
        chips = node["Resources"].get("TPU", 0)
        if chips <= 0:
            continue
        labels = node.get("Labels", {})
        if TOPOLOGY_LABEL not in labels or POD_TYPE_LABEL not in labels:
            raise ValueError(
                f"node {node['NodeID'][:12]} advertises TPU but Ray found no slice topology or "
                f"pod type for it ({TOPOLOGY_LABEL}, {POD_TYPE_LABEL}); start it with "
                f"TPU_ACCELERATOR_TYPE and TPU_TOPOLOGY set, or on a TPU VM")
        version = labels[POD_TYPE_LABEL].split("-")[0]  # "v4-16" -> "v4"
        shapes.add(TpuSliceShape(labels[TOPOLOGY_LABEL], version, int(chips)))
    if len(shapes) > 1:
        raise ValueError(f"the cluster mixes TPU slice shapes {sorted(map(str, shapes))}; one "
                         "deployment serves on one shape")
    return shapes.pop() if shapes else None


def _place_on_tpu_slices(shape: TpuSliceShape, nodes: list[dict], num_replicas: int,
                         hosts_per_replica: int, host_num_cpus: float) -> Placement:
    from ray.util.tpu import slice_placement_group

    if shape.num_hosts != hosts_per_replica:
        raise ValueError(
            f"hosts_per_replica: the cluster's TPU slices ({shape.accelerator_version} "
            f"{shape.topology}, {shape.chips_per_host} chips per host) have {shape.num_hosts} "
            f"host(s) each and a replica spans one slice, so hosts_per_replica must be "
            f"{shape.num_hosts}, not {hosts_per_replica}")
    selectors = None
    if hosts_per_replica > 1:  # pin bundle h to worker h, so the lead is on the slice's head
        selectors = [{WORKER_ID_LABEL: str(h)} for h in range(hosts_per_replica)] * num_replicas
    resources = {"TPU": shape.chips_per_host}
    slices = slice_placement_group(
        topology=shape.topology, accelerator_version=shape.accelerator_version,
        resources_per_bundle={"CPU": host_num_cpus, **resources}, num_slices=num_replicas,
        chips_per_vm=shape.chips_per_host, pg_per_slice=True, bundle_label_selector=selectors)
    groups = tuple(slices.slice_placement_groups)
    try:
        _wait_ready(groups, f"{num_replicas} TPU slice(s) of {shape.accelerator_version} "
                            f"{shape.topology}")
    finally:
        # Placed, the worker groups hold every chip of their slices; the head reservations that
        # kept two replicas from claiming one slice while they were being placed are done.
        slices.release_head_pgs()
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
    replicas = []
    for group in groups:
        node_of_bundle = placement_group_table(group)["bundles_to_node_id"]
        hostnames = ",".join(address[node_of_bundle[h]] for h in range(hosts_per_replica))
        replicas.append(tuple(
            HostSlot(group, h, host_num_cpus, resources,
                     {"TPU_WORKER_ID": str(h), "TPU_WORKER_HOSTNAMES": hostnames})
            for h in range(hosts_per_replica)))
    return Placement("tpu", tuple(replicas), groups)


def _place_on_cpus(nodes: list[dict], num_replicas: int, hosts_per_replica: int,
                   host_num_cpus: float) -> Placement:
    total = num_replicas * hosts_per_replica
    eligible = sum(n["Resources"].get("CPU", 0) >= host_num_cpus for n in nodes)
    strategy = "STRICT_SPREAD" if eligible >= total else "SPREAD"
    if strategy == "SPREAD" and total > 1:
        logger.warning("%d host actors on %d node(s) with %s CPUs free: some hosts share a node",
                       total, eligible, host_num_cpus)
    group = placement_group([{"CPU": host_num_cpus}] * total, strategy=strategy)
    _wait_ready((group,), f"{total} host(s) of {host_num_cpus} CPUs")
    replicas = tuple(
        tuple(HostSlot(group, r * hosts_per_replica + h, host_num_cpus)
              for h in range(hosts_per_replica))
        for r in range(num_replicas))
    return Placement("cpu", replicas, (group,))


def _wait_ready(groups: tuple[PlacementGroup, ...], what: str) -> None:
    try:
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for group in groups:
            remove_placement_group(group)
        raise RuntimeError(f"could not place {what} within {PLACEMENT_TIMEOUT_S:.0f}s; the "
                           f"cluster has {ray.available_resources()} available") from None
