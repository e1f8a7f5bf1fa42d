"""Where host actors go: one placement-group bundle per host, and on TPU every bundle a whole host.

``replica_shape`` reads what the cluster advertises and says, as plain data, what one replica
reserves (``ReplicaShape``: its bundles, strategy, label selectors and each host's environment), so
that a Serve deployment can hand the same bundles to ``placement_group_bundles``. ``reserve`` makes
the placement groups for some replicas and waits for them; ``slots_in`` gives the host slots of a
group that already exists (Serve's own). Three kinds of replica:

- CPU (no node advertises ``TPU``): one ``{"CPU": host_num_cpus}`` bundle per host,
  ``STRICT_SPREAD`` when the cluster has a node for every host, else ``SPREAD`` (a single
  development machine).
- One TPU host: one bundle ``{"CPU": host_num_cpus, "TPU": n}``, where ``n`` is every chip the node
  advertises. Nodes without slice labels qualify (Ray advertises ``TPU`` from the chips it finds,
  labels only from ``TPU_ACCELERATOR_TYPE`` / ``TPU_TOPOLOGY`` or the GCE metadata server); a node
  Ray knows to be one host of a bigger slice does not, since its chips cannot run alone.
- A multi-host TPU slice: Ray's ``ray.util.tpu.slice_placement_group`` reserves one whole slice
  through its ``TPU-<pod>-head`` resource and gang-schedules one whole-host bundle per host of that
  slice, bundle ``h`` pinned to the node labelled ``ray.io/tpu-worker-id=h`` (host 0, the lead, is
  the slice's worker 0, and libtpu's process 0). Plain bundles cannot promise that every host is on
  the same slice, so this reservation is made at run time
  (``ReplicaShape.needs_slice_reservation``), by whoever owns the replica.

Why whole hosts: for a request of one or two chips, or of fewer chips than the node has, Ray's TPU
support sets ``TPU_VISIBLE_CHIPS`` and ``TPU_HOST_BOUNDS=1,1,1`` in the actor's process, which tells
libtpu that this host is a slice of its own and cuts a multi-host slice apart. Every TPU host actor
takes every chip of its node, and starts with ``RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS`` so that
Ray writes none of those variables at all: a process that owns the whole host has nothing to mask
(on a real host Ray would have removed ``TPU_VISIBLE_CHIPS`` for it anyway).

A multi-host TPU slot also carries libtpu's view of the slice for its worker index
(``HostSlot.env_vars``, set through the actor's ``runtime_env`` so it is in place before torch_xla
starts): ``TPU_WORKER_ID``, the host's index, which libtpu takes as its process id, and
``TPU_WORKER_HOSTNAMES``, every host's address in worker order. GKE's TPU webhook sets both for a
pod, but to the pod's own view; setting them from the placement keeps them true to where the actors
run. On CPU machines that simulate a slice these variables are inert.
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
# Ray's switch (ray/_private/accelerators/tpu.py) that keeps it from writing TPU_VISIBLE_CHIPS,
# TPU_CHIPS_PER_HOST_BOUNDS and TPU_HOST_BOUNDS into an actor's process.
NOSET_VISIBLE_CHIPS_ENV = "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"

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
    """The shape of the cluster's TPU slices, read from the labels Ray puts on TPU nodes.

    ``topology`` and ``accelerator_version`` are None for a node that advertises ``TPU`` but no
    slice: it counts as a slice of one host.
    """

    topology: str | None  # e.g. "2x2x2"
    accelerator_version: str | None  # e.g. "v4", "v5litepod", "v6e"
    chips_per_host: int

    @property
    def num_hosts(self) -> int:
        if self.topology is None:
            return 1
        chips = math.prod(int(d) for d in self.topology.split("x"))
        return max(1, chips // self.chips_per_host)

    def describe(self) -> str:
        if self.topology is None:
            return f"TPU hosts of {self.chips_per_host} chips without slice labels"
        return (f"{self.accelerator_version} {self.topology} slices ({self.chips_per_host} chips "
                f"per host, {self.num_hosts} host(s) each)")


@dataclass(frozen=True)
class ReplicaShape:
    """What one replica reserves: one bundle per host (lead first), as plain data."""

    hosts: int
    host_num_cpus: float
    tpu: TpuSliceShape | None = None  # None: CPU hosts
    spread: bool = True  # CPU: the cluster has a node for every host, so none need share

    @property
    def mode(self) -> str:
        return "cpu" if self.tpu is None else "tpu"

    @property
    def bundle_resources(self) -> dict[str, float]:
        """One host's bundle: on TPU every chip of the node, never part of them."""
        if self.tpu is None:
            return {"CPU": self.host_num_cpus}
        return {"CPU": self.host_num_cpus, "TPU": float(self.tpu.chips_per_host)}

    @property
    def bundles(self) -> list[dict[str, float]]:
        return [self.bundle_resources for _ in range(self.hosts)]

    @property
    def strategy(self) -> str:
        if self.hosts == 1:
            return "STRICT_PACK"
        return "STRICT_SPREAD" if self.tpu is not None or self.spread else "SPREAD"

    @property
    def label_selectors(self) -> list[dict[str, str]] | None:
        """Bundle h on TPU worker h of a multi-host slice, so the lead is the slice's process 0."""
        if not self.needs_slice_reservation:
            return None
        return [{WORKER_ID_LABEL: str(h)} for h in range(self.hosts)]

    @property
    def needs_slice_reservation(self) -> bool:
        """True when bundles alone cannot keep every host on one slice (``reserve`` does it)."""
        return self.tpu is not None and self.hosts > 1

    def host_env(self, host_index: int, hostnames: list[str]) -> dict[str, str]:
        """The environment a host actor starts with (see the module docstring)."""
        if self.tpu is None:
            return {}
        env = {NOSET_VISIBLE_CHIPS_ENV: "1"}
        if self.hosts > 1:
            env.update(TPU_WORKER_ID=str(host_index), TPU_WORKER_HOSTNAMES=",".join(hostnames))
        return env


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


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


def place_hosts(num_replicas: int, hosts_per_replica: int, host_num_cpus: float) -> Placement:
    """Reserve one bundle per host for every replica; blocks until Ray has placed them."""
    shape = replica_shape(alive_nodes(), hosts_per_replica, host_num_cpus,
                          num_replicas=num_replicas)
    return reserve(shape, num_replicas)


def tpu_slice_shape(nodes: list[dict]) -> TpuSliceShape | None:
    """The cluster's TPU slice shape, or None when no node advertises TPU."""
    shapes = set()
    for node in nodes:
        chips = node["Resources"].get("TPU", 0)
        if chips <= 0:
            continue
        labels = node.get("Labels", {})
        if TOPOLOGY_LABEL in labels and POD_TYPE_LABEL in labels:
            version = labels[POD_TYPE_LABEL].split("-")[0]  # "v4-16" -> "v4"
            shapes.add(TpuSliceShape(labels[TOPOLOGY_LABEL], version, int(chips)))
        else:
            shapes.add(TpuSliceShape(None, None, int(chips)))
    if len(shapes) > 1:
        raise ValueError(f"the cluster mixes TPU slice shapes: "
                         f"{'; '.join(sorted(s.describe() for s in shapes))}; one deployment "
                         "serves on one shape")
    return shapes.pop() if shapes else None


def replica_shape(nodes: list[dict], hosts_per_replica: int, host_num_cpus: float, *,
                  num_replicas: int = 1) -> ReplicaShape:
    """What one replica reserves on a cluster of these nodes; raises ValueError naming the
    setting when a replica of that many hosts cannot be placed whole."""
    shape = tpu_slice_shape(nodes)
    if shape is None:
        eligible = sum(n["Resources"].get("CPU", 0) >= host_num_cpus for n in nodes)
        return ReplicaShape(hosts_per_replica, host_num_cpus,
                            spread=eligible >= num_replicas * hosts_per_replica)
    if shape.num_hosts != hosts_per_replica:
        if shape.topology is None:
            raise ValueError(
                f"hosts_per_replica: {hosts_per_replica} hosts cannot form one slice: the "
                f"cluster's TPU nodes carry no slice labels ({TOPOLOGY_LABEL}, "
                f"{POD_TYPE_LABEL}), so each is a replica of 1 host; start them with "
                "TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_NAME and TPU_WORKER_ID set, or on TPU "
                "VMs, for multi-host replicas")
        raise ValueError(
            f"hosts_per_replica: the cluster's TPU slices ({shape.accelerator_version} "
            f"{shape.topology}, {shape.chips_per_host} chips per host) have {shape.num_hosts} "
            f"host(s) each and a replica spans one slice, so hosts_per_replica must be "
            f"{shape.num_hosts}, not {hosts_per_replica}")
    return ReplicaShape(hosts_per_replica, host_num_cpus, tpu=shape)


def reserve(shape: ReplicaShape, num_replicas: int = 1) -> Placement:
    """Make and wait for the placement groups of ``num_replicas`` replicas of ``shape``."""
    if shape.tpu is None:
        if shape.hosts * num_replicas > 1 and not shape.spread:
            logger.warning("%d host actors on fewer nodes with %s CPUs free: some share a node",
                           shape.hosts * num_replicas, shape.host_num_cpus)
        # One group for all: STRICT_SPREAD then keeps every host of every replica apart.
        strategy = shape.strategy if shape.hosts * num_replicas == 1 else (
            "STRICT_SPREAD" if shape.spread else "SPREAD")
        group = placement_group(shape.bundles * num_replicas, strategy=strategy)
        _wait_ready((group,), f"{num_replicas * shape.hosts} host(s) of "
                              f"{shape.host_num_cpus} CPUs")
        replicas = tuple(slots_in(group, shape, r * shape.hosts) for r in range(num_replicas))
        return Placement("cpu", replicas, (group,))
    if not shape.needs_slice_reservation:
        groups = tuple(placement_group(shape.bundles, strategy=shape.strategy)
                       for _ in range(num_replicas))
        _wait_ready(groups, f"{num_replicas} whole TPU host(s) of {shape.tpu.chips_per_host} "
                            "chips")
    else:
        groups = _reserve_slices(shape, num_replicas)
    return Placement("tpu", tuple(slots_in(g, shape) for g in groups), groups)


def _reserve_slices(shape: ReplicaShape, num_replicas: int) -> tuple[PlacementGroup, ...]:
    from ray.util.tpu import slice_placement_group

    tpu = shape.tpu
    slices = slice_placement_group(
        topology=tpu.topology, accelerator_version=tpu.accelerator_version,
        resources_per_bundle=shape.bundle_resources, num_slices=num_replicas,
        chips_per_vm=tpu.chips_per_host, pg_per_slice=True,
        bundle_label_selector=shape.label_selectors * num_replicas)
    groups = tuple(slices.slice_placement_groups)
    try:
        _wait_ready(groups, f"{num_replicas} TPU slice(s) of {tpu.describe()}")
    finally:
        # Placed, the worker groups hold every chip of their slices; the head reservations that
        # kept two replicas from claiming one slice while they were being placed are done.
        slices.release_head_pgs()
    return groups


def slots_in(group: PlacementGroup, shape: ReplicaShape,
             first_bundle: int = 0) -> tuple[HostSlot, ...]:
    """The host slots (lead first) of one replica in a placed group, from ``first_bundle`` on."""
    resources = {k: v for k, v in shape.bundle_resources.items() if k != "CPU"}
    hostnames: list[str] = []
    if shape.needs_slice_reservation:
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in alive_nodes()}
        node_of_bundle = placement_group_table(group)["bundles_to_node_id"]
        hostnames = [address[node_of_bundle[first_bundle + h]] for h in range(shape.hosts)]
    return tuple(HostSlot(group, first_bundle + h, shape.host_num_cpus, resources,
                          shape.host_env(h, hostnames))
                 for h in range(shape.hosts))


def _wait_ready(groups: tuple[PlacementGroup, ...], what: str) -> None:
    try:
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for group in groups:
            remove_placement_group(group)
        raise RuntimeError(f"could not place {what} within {PLACEMENT_TIMEOUT_S:.0f}s; the "
                           f"cluster has {ray.available_resources()} available") from None
