"""KubeRay ``RayService`` manifests for meshserve on GKE TPU slices.

``render(Deployment(...))`` is a pure function from a few choices (TPU generation, slice topology,
model path, number of replicas) to the manifest as a plain dict; ``to_yaml`` writes it out, headed
by the command that reproduces it and the node pools it needs.
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from meshserve.kuberay.deployment import (API_KEY_ENV, CACHE_MOUNT, DEFAULTS, OPTIONAL_FLAGS,
                                          WEIGHTS_MOUNT, Deployment)

# Ray inside the image (pyproject pins ray[serve]==2.60.0). KubeRay reads rayVersion to pick its
# probes: from Ray 2.53 an HTTP check of the dashboard agent instead of exec + wget (RayService
# workers still get a wget check of the Serve proxy for readiness).
RAY_VERSION = "2.60.0"
APP_IMPORT_PATH = "meshserve.deploy.app:build_app"
APP_NAME = "meshserve"
# Kubernetes service account bound (Workload Identity) to read and write the bucket.
SERVICE_ACCOUNT = "meshserve"
SERVE_PORT = 8000

# Atomic slice recreation (KubeRay PRs #3998, #4163, #4572): with this operator feature gate on and
# numOfHosts > 1, KubeRay labels every pod of a worker-group replica with the replica's name and
# the pod's host index, and when one pod of a replica fails it deletes all of them and creates the
# slice anew. Alpha (off by default) in 1.5, beta and on by default from 1.6.
SLICE_RECREATION_GATE = "RayMultiHostIndexing"
MIN_KUBERAY_VERSION = "1.6.0"
# The labels KubeRay sets on each multi-host worker pod, and groups the pods of a slice by. It
# ignores multi-host pods that lack them, so the manifest never sets them itself.
REPLICA_NAME_LABEL = "ray.io/worker-group-replica-name"
REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
HOST_INDEX_LABEL = "ray.io/replica-host-index"

# The TPU workers' readiness probe (probe.py): KubeRay's raylet check plus a one-token completion
# through the pod's Serve proxy. Timeouts sit above the probe's own deadline so that the kubelet
# sees its message; two failures in a row (about 20 s of stall) take the pod out of the Service.
PROBE_DEADLINE_S = 10
PROBE_PERIOD_S = 10
PROBE_FAILURES = 2


def app_args(d: Deployment) -> dict[str, Any]:
    """The ``args`` of the Serve application: what ``build_app`` receives."""
    tpu = d.tpu_slice
    args: dict[str, Any] = {
        "model": d.model,
        "served_model_name": d.model_name,
        "device": "xla",
        "dtype": "bfloat16",
        # One replica spans the whole slice: every chip is in its tensor-parallel group.
        "tensor_parallel_size": tpu.chips,
        "hosts_per_replica": tpu.hosts,
        "num_replicas": d.replicas,
        "max_num_seqs": d.max_num_seqs,
        "max_num_batched_tokens": d.max_num_batched_tokens,
        "max_model_len": d.max_model_len,
        # One folder per deployment: shapes differ, and concurrent writers stay apart.
        "compile_cache_dir": f"{CACHE_MOUNT}/{d.service_name}",
    }
    if d.api_key_secret:
        args["api_key_env"] = API_KEY_ENV
    return args


def serve_config(d: Deployment) -> dict[str, Any]:
    """The Serve config that KubeRay submits to the cluster (``serveConfigV2``)."""
    return {
        # A proxy on every node with a replica: the serve Service load-balances over all of them.
        "proxy_location": "EveryNode",
        # Inside the pod Serve must listen beyond loopback for the Service to reach it.
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": APP_IMPORT_PATH,
            "args": app_args(d),
        }],
    }


def _api_key_env(d: Deployment) -> list[dict[str, Any]]:
    if not d.api_key_secret:
        return []
    return [{"name": API_KEY_ENV,
             "valueFrom": {"secretKeyRef": {"name": d.api_key_secret, "key": "api-key"}}}]


def _shm_volume() -> dict[str, Any]:
    # Ray's object store lives in /dev/shm; a container's default 64 MiB would starve it.
    # KubeRay adds this volume itself when missing; naming it as KubeRay does keeps one copy.
    return {"name": "shared-mem", "emptyDir": {"medium": "Memory"}}


def _gcs_volume(name: str, bucket: str, folder: str, read_only: bool) -> dict[str, Any]:
    csi: dict[str, Any] = {
        "driver": "gcsfuse.csi.storage.gke.io",
        "volumeAttributes": {"bucketName": bucket,
                             "mountOptions": f"implicit-dirs,only-dir={folder}"},
    }
    if read_only:
        csi["readOnly"] = True
    return {"name": name, "csi": csi}


def _head_group(d: Deployment) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "ray-head",
        "image": d.image,
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                      "limits": {"cpu": "4", "memory": "16Gi"}},
        "ports": [{"name": "gcs-server", "containerPort": 6379},
                  {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001},
                  {"name": "serve", "containerPort": SERVE_PORT}],
        "volumeMounts": [{"name": "shared-mem", "mountPath": "/dev/shm"}],
    }
    if env := _api_key_env(d):
        container["env"] = env
    return {
        # num-cpus 0: Ray schedules no replica or task that needs a CPU on the head, so the GCS,
        # the Serve controller and the head's proxy keep the pod to themselves; the TPU hosts
        # have more than a hundred cores each for the ingress and router.
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"spec": {"containers": [container], "volumes": [_shm_volume()]}},
    }


def _readiness_probe(d: Deployment) -> dict[str, Any]:
    return {
        "exec": {"command": ["python", "-m", "meshserve.kuberay.probe", "--model", d.model_name,
                             "--port", str(SERVE_PORT), "--deadline", str(PROBE_DEADLINE_S)]},
        "initialDelaySeconds": PROBE_PERIOD_S,
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": PROBE_DEADLINE_S + 5,
        "failureThreshold": PROBE_FAILURES,
    }


def _worker_group(d: Deployment) -> dict[str, Any]:
    tpu = d.tpu_slice
    chips = str(tpu.machine.chips)
    # Three quarters of the VM: the rest is for GKE's daemons and the GCS FUSE sidecar. Requests
    # equal limits so the pods are Guaranteed and evicted last under memory pressure.
    cpu = str(tpu.machine.vcpus * 3 // 4)
    memory = f"{tpu.machine.memory_gib * 3 // 4}Gi"
    container: dict[str, Any] = {
        "name": "ray-worker",
        "image": d.image,
        "resources": {
            "requests": {"cpu": cpu, "memory": memory, "google.com/tpu": chips},
            "limits": {"cpu": cpu, "memory": memory, "google.com/tpu": chips},
        },
        "ports": [{"name": "serve", "containerPort": SERVE_PORT}],
        # Given here, so KubeRay injects only its liveness probe (the raylet, which warm-up never
        # trips); readiness asks for a completed request, so a stalled path leaves the Service.
        "readinessProbe": _readiness_probe(d),
        "volumeMounts": [
            {"name": "shared-mem", "mountPath": "/dev/shm"},
            {"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True},
            {"name": "xla-cache", "mountPath": CACHE_MOUNT},
        ],
    }
    if env := _api_key_env(d):
        container["env"] = env
    pod: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": tpu.generation.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": tpu.topology,
        },
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "volumes": [
            _shm_volume(),
            _gcs_volume("weights", d.bucket, "models", read_only=True),
            _gcs_volume("xla-cache", d.bucket, "xla-cache", read_only=False),
        ],
    }
    if tpu.hosts > 1:
        # A host whose Ray container exits must fail its pod: KubeRay deletes only failed pods,
        # and then (RayMultiHostIndexing) the whole slice with it. Under the default "Always"
        # the kubelet would restart the container in place, beside hosts whose slice is gone.
        pod["restartPolicy"] = "Never"
    return {
        "groupName": f"tpu-{d.accelerator}-{d.topology}",
        # No autoscaling: a replica is a whole slice, so the group is pinned to `replicas`.
        "replicas": d.replicas,
        "minReplicas": d.replicas,
        "maxReplicas": d.replicas,
        # One pod per TPU VM; KubeRay creates and deletes a replica's pods together.
        "numOfHosts": tpu.hosts,
        "template": {
            "metadata": {"annotations": {
                "gke-gcsfuse/volumes": "true",
                # "0" lifts the sidecar's default limits, which throttle reading large weights.
                "gke-gcsfuse/cpu-limit": "0",
                "gke-gcsfuse/memory-limit": "0",
                "gke-gcsfuse/ephemeral-storage-limit": "0",
            }},
            "spec": pod,
        },
    }


def render(d: Deployment) -> dict[str, Any]:
    """The RayService manifest for ``d`` as a plain dict (no I/O, no cluster)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": d.service_name,
                     "labels": {"app.kubernetes.io/name": "meshserve"}},
        "spec": {
            # None: a changed serveConfigV2 is applied in place on the running cluster, and
            # KubeRay never builds a second cluster beside it (which would need twice the TPUs).
            # See k8s/README.md, "Upgrades".
            "upgradeStrategy": {"type": "None"},
            "serveConfigV2": yaml.safe_dump(serve_config(d), sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": _head_group(d),
                "workerGroupSpecs": [_worker_group(d)],
            },
        },
    }


def command_line(d: Deployment) -> str:
    """The ``meshserve k8s render`` invocation that reproduces ``d`` (defaults left out)."""
    words = ["meshserve", "k8s", "render", "--accelerator", d.accelerator,
             "--topology", d.topology, "--model", d.model]
    for field, flag in OPTIONAL_FLAGS:
        value = getattr(d, field)
        if value != DEFAULTS[field]:
            words += [flag, str(value)]
    return shlex.join(words)


def node_pool_commands(d: Deployment) -> list[str]:
    """``gcloud`` commands for the TPU node pool(s) the manifest schedules onto."""
    tpu = d.tpu_slice
    base = (f"gcloud container node-pools create {{pool}} --cluster=$CLUSTER --location=$ZONE "
            f"--machine-type={tpu.machine.name}")
    pool = f"tpu-{d.accelerator}-{d.topology}"
    if tpu.hosts == 1:
        # Single-host slices: one node per replica in a single pool.
        return [base.format(pool=pool) + f" --num-nodes={d.replicas}"]
    # A multi-host pool is exactly one slice, created and repaired as a unit: one per replica.
    names = [pool] if d.replicas == 1 else [f"{pool}-{i}" for i in range(d.replicas)]
    return [base.format(pool=name) + f" --tpu-topology={tpu.topology} --num-nodes={tpu.hosts}"
            for name in names]


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so serveConfigV2 reads as YAML inside YAML."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(d: Deployment) -> str:
    """The manifest for ``d`` as YAML, headed by how to reproduce it and where it runs."""
    header = [f"Rendered by: {command_line(d)}",
              "TPU node pool(s) it schedules onto:"]
    header += [f"  {command}" for command in node_pool_commands(d)]
    if d.tpu_slice.hosts > 1:
        header += [f"Needs KubeRay >= {MIN_KUBERAY_VERSION} with the {SLICE_RECREATION_GATE} "
                   "feature gate on (the default from 1.6),",
                   "so that a slice whose host fails is recreated whole (k8s/README.md, "
                   "\"When a host of a slice dies\")."]
    body = yaml.dump(render(d), Dumper=_Dumper, sort_keys=False, width=100)
    return "".join(f"# {line}\n" for line in header) + body
