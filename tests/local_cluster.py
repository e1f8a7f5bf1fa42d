"""Local Ray clusters for tests: every socket on 127.0.0.1, and nodes that Ray takes for TPU hosts.

A simulated TPU node is a CPU process that advertises ``{"TPU": 4}``; started with the variables
Ray reads on a TPU VM (``TPU_NAME``, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``,
``TPU_WORKER_ID``), it also gets the slice's labels and its ``TPU-<pod>-head`` resource.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster


@contextmanager
def local_cluster(workers: int = 0, head_cpus: int = 1, worker_cpus: int = 1
                  ) -> Iterator[Cluster]:
    """A head and ``workers`` CPU nodes, with this process connected to them."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=head_cpus, node_ip_address="127.0.0.1", include_dashboard=False))
    nodes = [cluster.add_node(num_cpus=worker_cpus, node_ip_address="127.0.0.1")
             for _ in range(workers)]
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        for node in nodes:
            cluster.remove_node(node)
        cluster.shutdown()


@contextmanager
def tpu_nodes(cluster: Cluster, envs: list[dict[str, str]], num_cpus: int = 1) -> Iterator[None]:
    """Nodes advertising {"TPU": 4}, each started with one of ``envs`` (Ray reads the TPU
    variables from the process that starts the raylet as well as from the node's own)."""
    added = []
    for env in envs:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            added.append(cluster.add_node(num_cpus=num_cpus, resources={"TPU": 4},
                                          node_ip_address="127.0.0.1", env_vars=env))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
    cluster.wait_for_nodes()
    try:
        yield
    finally:
        for node in added:
            cluster.remove_node(node)
