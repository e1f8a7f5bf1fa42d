"""Placement on TPU: every bundle a whole host, one-host replicas on nodes without slice labels,
multi-host replicas on one slice with worker h in bundle h.

The plain-data checks read node dicts shaped like ``ray.nodes()``. The cluster checks run a local
Ray cluster (every socket on 127.0.0.1) whose "TPU" nodes are CPU processes that advertise
``{"TPU": 4}``, some with the environment Ray reads on a v4-16 slice, some with none; a small actor
started in each slot reports the TPU variables its process sees.
"""

from __future__ import annotations

import os
import uuid

import pytest
import ray
from meshserve.actors.placement import (NOSET_VISIBLE_CHIPS_ENV, ReplicaShape, TpuSliceShape,
                                        place_hosts, replica_shape, tpu_slice_shape)
from tests.local_cluster import local_cluster, tpu_nodes

# The variables Ray's TPU support writes into a process that holds part of a host's chips.
TPU_BOUNDS = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS")
V4_16 = dict(TPU_NAME="slice-a", TPU_ACCELERATOR_TYPE="v4-16", TPU_TOPOLOGY="2x2x2")


def node(resources: dict, labels: dict | None = None) -> dict:
    return {"NodeID": uuid.uuid4().hex, "Alive": True, "Resources": resources,
            "Labels": labels or {}, "NodeManagerAddress": "127.0.0.1"}


def tpu_node(chips: int, pod_type: str | None = None, topology: str | None = None) -> dict:
    labels = {} if pod_type is None else {"ray.io/tpu-pod-type": pod_type,
                                          "ray.io/tpu-topology": topology}
    return node({"CPU": 8, "TPU": chips}, labels)


# --- Plain data --------------------------------------------------------------------------------


def test_one_host_replicas_on_unlabelled_tpu_nodes_take_plain_whole_host_bundles() -> None:
    nodes = [node({"CPU": 4}), tpu_node(8), tpu_node(8)]
    assert tpu_slice_shape(nodes) == TpuSliceShape(None, None, 8)
    shape = replica_shape(nodes, hosts_per_replica=1, host_num_cpus=2)
    assert shape.mode == "tpu" and not shape.needs_slice_reservation
    assert shape.bundles == [{"CPU": 2, "TPU": 8}]
    assert shape.label_selectors is None
    assert shape.host_env(0, []) == {NOSET_VISIBLE_CHIPS_ENV: "1"}  # no slice to describe
    with pytest.raises(ValueError, match="hosts_per_replica: 2 hosts cannot form one slice.*"
                                         "no slice labels.*TPU_TOPOLOGY"):
        replica_shape(nodes, hosts_per_replica=2, host_num_cpus=2)


@pytest.mark.parametrize("pod_type, topology, chips, hosts", [
    ("v4-16", "2x2x2", 4, 2), ("v6e-16", "4x4", 4, 4), ("v5litepod-8", "2x4", 8, 1),
    ("v4-8", "2x2x1", 4, 1),
])
def test_every_tpu_bundle_is_every_chip_of_a_host(pod_type: str, topology: str, chips: int,
                                                 hosts: int) -> None:
    nodes = [node({"CPU": 4})] + [tpu_node(chips, pod_type, topology) for _ in range(hosts)]
    shape = replica_shape(nodes, hosts_per_replica=hosts, host_num_cpus=1)
    assert shape.bundles == [{"CPU": 1, "TPU": chips}] * hosts
    assert shape.needs_slice_reservation == (hosts > 1)
    if hosts > 1:
        assert shape.strategy == "STRICT_SPREAD"
        assert shape.label_selectors == [{"ray.io/tpu-worker-id": str(h)} for h in range(hosts)]
        names = [f"10.0.0.{h}" for h in range(hosts)]
        assert [shape.host_env(h, names) for h in range(hosts)] == [
            {NOSET_VISIBLE_CHIPS_ENV: "1", "TPU_WORKER_ID": str(h),
             "TPU_WORKER_HOSTNAMES": ",".join(names)} for h in range(hosts)]
    # A replica smaller than its slice would leave chips that nothing can run alone.
    if hosts > 1:
        with pytest.raises(ValueError, match=f"have {hosts} host.*must be {hosts}, not 1"):
            replica_shape(nodes, hosts_per_replica=1, host_num_cpus=1)


def test_cpu_replicas_spread_when_the_cluster_has_a_node_per_host() -> None:
    three = [node({"CPU": 2}) for _ in range(3)]
    shape = replica_shape(three, hosts_per_replica=3, host_num_cpus=1)
    assert (shape.mode, shape.bundles, shape.strategy) == ("cpu", [{"CPU": 1}] * 3,
                                                          "STRICT_SPREAD")
    assert shape.host_env(1, []) == {}
    assert replica_shape(three[:1], hosts_per_replica=2, host_num_cpus=1).strategy == "SPREAD"
    assert ReplicaShape(1, 1.0).strategy == "STRICT_PACK"


def test_mixed_tpu_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="mixes TPU slice shapes: TPU hosts of 4 chips without "
                                         "slice labels; v4 2x2x2 slices"):
        tpu_slice_shape([tpu_node(4), tpu_node(4, "v4-16", "2x2x2")])


# --- A local cluster ---------------------------------------------------------------------------


class EnvReport:
    """Reports what a host actor's process would see: the TPU variables and its chips."""

    def report(self) -> dict:
        return {"env": {k: os.environ[k] for k in TPU_BOUNDS if k in os.environ},
                "chips": ray.get_runtime_context().get_accelerator_ids().get("TPU", []),
                "node": ray.get_runtime_context().get_node_id(),
                "worker_id": os.environ.get("TPU_WORKER_ID")}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster() as cluster:
        yield cluster


def reports(placement) -> list[list[dict]]:
    actors = [[ray.remote(EnvReport).options(**slot.actor_options()).remote() for slot in slots]
              for slots in placement.replicas]
    try:
        return [ray.get([a.report.remote() for a in hosts], timeout=120) for hosts in actors]
    finally:
        for hosts in actors:
            for actor in hosts:
                ray.kill(actor)


@pytest.mark.slow
def test_a_partial_chip_request_would_cut_the_slice_and_placement_never_makes_one(cluster):
    with tpu_nodes(cluster, [{**V4_16, "TPU_WORKER_ID": str(w)} for w in range(2)]):
        # What Ray does to a process that holds one of a host's chips: a slice of its own.
        partial = ray.remote(EnvReport).options(num_cpus=0, resources={"TPU": 1}).remote()
        seen = ray.get(partial.report.remote(), timeout=120)
        assert seen["env"]["TPU_HOST_BOUNDS"] == "1,1,1", seen
        ray.kill(partial)

        placement = place_hosts(num_replicas=1, hosts_per_replica=2, host_num_cpus=1)
        try:
            (hosts,) = reports(placement)
        finally:
            placement.release()
        assert placement.mode == "tpu"
        assert [h["env"] for h in hosts] == [{}, {}]  # no bounds, no mask: the whole slice
        assert [sorted(h["chips"]) for h in hosts] == [["0", "1", "2", "3"]] * 2
        assert len({h["node"] for h in hosts}) == 2
        assert [h["worker_id"] for h in hosts] == ["0", "1"]
        labels = {n["NodeID"]: n["Labels"] for n in ray.nodes() if n["Alive"]}
        assert [labels[h["node"]]["ray.io/tpu-worker-id"] for h in hosts] == ["0", "1"]


@pytest.mark.slow
def test_one_host_replicas_run_on_tpu_nodes_without_slice_labels(cluster):
    with tpu_nodes(cluster, [{}, {}]):
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        assert not any("ray.io/tpu-topology" in n["Labels"] for n in nodes.values())
        placement = place_hosts(num_replicas=2, hosts_per_replica=1, host_num_cpus=1)
        try:
            replicas = reports(placement)
        finally:
            placement.release()
        assert placement.mode == "tpu"
        hosts = [host for (host,) in replicas]
        assert len({h["node"] for h in hosts}) == 2  # the chips of one node go to one replica
        assert all(nodes[h["node"]]["Resources"]["TPU"] == 4 for h in hosts)
        assert [sorted(h["chips"]) for h in hosts] == [["0", "1", "2", "3"]] * 2
        assert [h["env"] for h in hosts] == [{}, {}]
        with pytest.raises(ValueError, match="no slice labels"):
            place_hosts(num_replicas=1, hosts_per_replica=2, host_num_cpus=1)
