"""KubeRay ``RayService`` manifests for meshserve on GKE TPU slices.

``render(Deployment(...))`` is a pure function from a few choices (TPU generation, slice topology,
model path, number of replicas) to the manifest as a plain dict; ``to_yaml`` writes it out. The
committed manifests in ``k8s/`` are this module's output for ``EXAMPLES``; regenerate them with
``python -m meshserve.deploy.k8s --write-examples`` (a test keeps them in sync). The CLI hook
``add_k8s_parser`` registers ``meshserve k8s render``.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import yaml

# Ray inside the image (pyproject pins ray[serve]==2.60.0). KubeRay reads rayVersion to pick its
# probes: from Ray 2.53 an HTTP check of the dashboard agent instead of exec + wget (RayService
# workers still get a wget check of the Serve proxy for readiness).
RAY_VERSION = "2.60.0"
APP_IMPORT_PATH = "meshserve.deploy.app:build_app"
APP_NAME = "meshserve"
# Placeholders that work as strings but point nowhere: render with --image/--bucket for real use.
DEFAULT_IMAGE = "us-docker.pkg.dev/my-project/meshserve/meshserve-tpu:0.1.0"
DEFAULT_BUCKET = "my-project-meshserve"
# Kubernetes service account bound (Workload Identity) to read and write the bucket.
SERVICE_ACCOUNT = "meshserve"
WEIGHTS_MOUNT = "/models"
CACHE_MOUNT = "/xla-cache"
SERVE_PORT = 8000
API_KEY_ENV = "MESHSERVE_API_KEY"
# KubeRay rejects longer RayService names: the RayCluster it creates adds a 6-character suffix,
# and "<cluster>-serve-svc" must still fit in a 63-character DNS label.
MAX_NAME_LENGTH = 47
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


# --- GKE TPU facts --------------------------------------------------------------------------
# Sources: the Cloud TPU pages "TPU v5e" and "TPU v6e" (2D topologies, VMs per slice, GKE machine
# types), GKE's "Plan TPUs in GKE" (node label values, the 3D shapes of v4 and v5p) and Compute
# Engine's machine type listings (vCPUs and memory, used only to size pod requests). GKE labels
# TPU nodes with cloud.google.com/gke-tpu-accelerator and cloud.google.com/gke-tpu-topology.


@dataclass(frozen=True, slots=True)
class MachineType:
    """A GKE TPU VM shape: how many chips one Kubernetes node (one pod) owns."""

    name: str
    chips: int
    vcpus: int
    memory_gib: int


@dataclass(frozen=True, slots=True)
class TpuGeneration:
    """One TPU generation as GKE offers it: single-host shapes and multi-host slices."""

    name: str
    gke_accelerator: str
    # topology -> the machine type that holds the whole slice on one VM.
    single_host: tuple[tuple[str, MachineType], ...]
    # Multi-host slices are built from 4-chip VMs of this type.
    multi_host_machine: MachineType
    multi_host_topologies: tuple[str, ...]

    @property
    def topologies(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.single_host) + self.multi_host_topologies


_CT5LP_1T = MachineType("ct5lp-hightpu-1t", chips=1, vcpus=24, memory_gib=48)
_CT5LP_4T = MachineType("ct5lp-hightpu-4t", chips=4, vcpus=112, memory_gib=192)
_CT5LP_8T = MachineType("ct5lp-hightpu-8t", chips=8, vcpus=224, memory_gib=384)
_CT6E_1T = MachineType("ct6e-standard-1t", chips=1, vcpus=44, memory_gib=176)
_CT6E_4T = MachineType("ct6e-standard-4t", chips=4, vcpus=180, memory_gib=720)
_CT6E_8T = MachineType("ct6e-standard-8t", chips=8, vcpus=180, memory_gib=1440)
_CT5P_4T = MachineType("ct5p-hightpu-4t", chips=4, vcpus=208, memory_gib=448)
_CT4P_4T = MachineType("ct4p-hightpu-4t", chips=4, vcpus=240, memory_gib=407)

# v5e and v6e also come as 2x4 on two 4-chip VMs; the renderer always takes the one 8-chip VM,
# which keeps a tensor-parallel group on one host. 3D shapes stop at 8x8x8 (128 hosts): bigger
# slices exist for training but are far past what one serving replica needs.
_PLANAR_MULTI_HOST = ("4x4", "4x8", "8x8", "8x16", "16x16")
_CUBIC_MULTI_HOST = ("2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8")

GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v4", "tpu-v4-podslice", (("2x2x1", _CT4P_4T),), _CT4P_4T,
                      _CUBIC_MULTI_HOST),
        TpuGeneration("v5e", "tpu-v5-lite-podslice",
                      (("1x1", _CT5LP_1T), ("2x2", _CT5LP_4T), ("2x4", _CT5LP_8T)), _CT5LP_4T,
                      _PLANAR_MULTI_HOST),
        TpuGeneration("v5p", "tpu-v5p-slice", (("2x2x1", _CT5P_4T),), _CT5P_4T,
                      _CUBIC_MULTI_HOST),
        TpuGeneration("v6e", "tpu-v6e-slice",
                      (("1x1", _CT6E_1T), ("2x2", _CT6E_4T), ("2x4", _CT6E_8T)), _CT6E_4T,
                      _PLANAR_MULTI_HOST),
    )
}


@dataclass(frozen=True, slots=True)
class TpuSlice:
    """A supported (generation, topology) pair and the machine type GKE builds it from."""

    generation: TpuGeneration
    topology: str
    machine: MachineType

    @property
    def chips(self) -> int:
        return math.prod(int(d) for d in self.topology.split("x"))

    @property
    def hosts(self) -> int:
        return self.chips // self.machine.chips


def resolve_slice(accelerator: str, topology: str) -> TpuSlice:
    """The slice for ``accelerator`` and ``topology``; ``ValueError`` names the valid choices."""
    generation = GENERATIONS.get(accelerator)
    if generation is None:
        raise ValueError(f"accelerator: {accelerator!r} is not supported; "
                         f"choose one of {', '.join(GENERATIONS)}")
    for single_topology, machine in generation.single_host:
        if topology == single_topology:
            return TpuSlice(generation, topology, machine)
    if topology in generation.multi_host_topologies:
        return TpuSlice(generation, topology, generation.multi_host_machine)
    raise ValueError(f"topology: TPU {accelerator} has no {topology!r} slice on GKE; valid "
                     f"topologies: {', '.join(generation.topologies)}")


# --- What to deploy -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Deployment:
    """Everything ``render`` needs; validates itself so a bad flag fails before any YAML."""

    accelerator: str
    topology: str
    model: str  # path of the weights inside the pod, normally under WEIGHTS_MOUNT
    replicas: int = 1  # TPU slices, one model replica each, behind one router
    image: str = DEFAULT_IMAGE
    name: str | None = None  # RayService name; derived from the slice when None
    bucket: str = DEFAULT_BUCKET
    served_model_name: str | None = None  # the "model" clients send; the folder name when None
    max_model_len: int = 4096
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    api_key_secret: str | None = None  # Secret with key "api-key"; None serves without a key

    def __post_init__(self) -> None:
        resolve_slice(self.accelerator, self.topology)
        if not self.model.startswith("/"):
            raise ValueError(f"model: {self.model!r} must be an absolute path inside the pod, "
                             f"e.g. {WEIGHTS_MOUNT}/Llama-3.1-8B-Instruct")
        for field in ("replicas", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: must be at least 1")
        if len(self.service_name) > MAX_NAME_LENGTH or not _DNS1035_LABEL.match(
                self.service_name):
            raise ValueError(f"name: {self.service_name!r} must be a lowercase DNS-1035 label "
                             f"of at most {MAX_NAME_LENGTH} characters")

    @property
    def tpu_slice(self) -> TpuSlice:
        return resolve_slice(self.accelerator, self.topology)

    @property
    def service_name(self) -> str:
        if self.name is not None:
            return self.name
        suffix = f"-dp{self.replicas}" if self.replicas > 1 else ""
        return f"meshserve-{self.accelerator}-{self.topology}{suffix}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Deployment)}


# --- Rendering ------------------------------------------------------------------------------


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
        # KubeRay's readiness probe for RayService workers checks the Serve proxy on this port.
        "ports": [{"name": "serve", "containerPort": SERVE_PORT}],
        "volumeMounts": [
            {"name": "shared-mem", "mountPath": "/dev/shm"},
            {"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True},
            {"name": "xla-cache", "mountPath": CACHE_MOUNT},
        ],
    }
    if env := _api_key_env(d):
        container["env"] = env
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
            "spec": {
                "serviceAccountName": SERVICE_ACCOUNT,
                "nodeSelector": {
                    "cloud.google.com/gke-tpu-accelerator": tpu.generation.gke_accelerator,
                    "cloud.google.com/gke-tpu-topology": tpu.topology,
                },
                "tolerations": [{"key": "google.com/tpu", "operator": "Exists",
                                 "effect": "NoSchedule"}],
                "containers": [container],
                "volumes": [
                    _shm_volume(),
                    _gcs_volume("weights", d.bucket, "models", read_only=True),
                    _gcs_volume("xla-cache", d.bucket, "xla-cache", read_only=False),
                ],
            },
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


# --- Text around the manifest ---------------------------------------------------------------


def command_line(d: Deployment) -> str:
    """The ``meshserve k8s render`` invocation that reproduces ``d`` (defaults left out)."""
    words = ["meshserve", "k8s", "render", "--accelerator", d.accelerator,
             "--topology", d.topology, "--model", d.model]
    for field, flag in _OPTIONAL_FLAGS:
        value = getattr(d, field)
        if value != _DEFAULTS[field]:
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
    body = yaml.dump(render(d), Dumper=_Dumper, sort_keys=False, width=100)
    return "".join(f"# {line}\n" for line in header) + body


# --- Committed examples ---------------------------------------------------------------------

EXAMPLES: dict[str, Deployment] = {
    "v5e-2x4-single-host.yaml": Deployment("v5e", "2x4", "/models/Llama-3.1-8B-Instruct"),
    "v6e-4x4-multi-host.yaml": Deployment("v6e", "4x4", "/models/Llama-3.3-70B-Instruct"),
    "v6e-2x4-data-parallel.yaml": Deployment("v6e", "2x4", "/models/Qwen2.5-32B-Instruct",
                                             replicas=2),
}
# Meaningful in a source checkout only, which is where examples are regenerated.
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "k8s"


def write_examples(directory: Path = EXAMPLES_DIR) -> list[Path]:
    """Regenerate the committed manifests; returns the paths written."""
    paths = []
    for filename, deployment in EXAMPLES.items():
        path = directory / filename
        path.write_text(to_yaml(deployment))
        paths.append(path)
    return paths


# --- Command line ---------------------------------------------------------------------------

# Deployment field -> flag, for the optional flags (shared by the parser and command_line).
_OPTIONAL_FLAGS = (
    ("replicas", "--replicas"),
    ("image", "--image"),
    ("name", "--name"),
    ("bucket", "--bucket"),
    ("served_model_name", "--served-model-name"),
    ("max_model_len", "--max-model-len"),
    ("max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("api_key_secret", "--api-key-secret"),
)


def add_k8s_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``k8s render`` on a CLI; the handler is ``args.func(args) -> int``."""
    k8s = subparsers.add_parser("k8s", help="KubeRay manifests for GKE TPU slices")
    commands = k8s.add_subparsers(dest="k8s_command", required=True)
    render_parser = commands.add_parser(
        "render", help="print a RayService manifest for a TPU slice",
        description="Render a KubeRay RayService that serves a model on GKE TPU slices.")
    render_parser.add_argument("--accelerator", required=True, choices=sorted(GENERATIONS))
    render_parser.add_argument("--topology", required=True,
                               help="slice shape as GKE names it, e.g. 2x4 or 2x2x2")
    render_parser.add_argument("--model", required=True,
                               help=f"weights folder inside the pod, e.g. {WEIGHTS_MOUNT}/NAME")
    helps = {
        "replicas": "TPU slices, one model replica each (data parallel)",
        "image": "container image built from k8s/Dockerfile",
        "name": "RayService name (default: meshserve-ACCELERATOR-TOPOLOGY)",
        "bucket": f"GCS bucket with models/ and xla-cache/ folders, mounted at "
                  f"{WEIGHTS_MOUNT} and {CACHE_MOUNT}",
        "served_model_name": "model name clients send (default: the folder name)",
        "api_key_secret": f"Secret whose key 'api-key' becomes {API_KEY_ENV}",
    }
    for field, flag in _OPTIONAL_FLAGS:
        default = _DEFAULTS[field]
        kind = int if isinstance(default, int) else str
        render_parser.add_argument(flag, dest=field, type=kind, default=default,
                                   help=helps.get(field, f"engine limit (default {default})"))
    render_parser.add_argument("--output", "-o", default="-",
                               help="file to write (default: standard output)")
    render_parser.set_defaults(func=_run_render)
    return render_parser


def _run_render(args: argparse.Namespace) -> int:
    names = ["accelerator", "topology", "model"] + [field for field, _ in _OPTIONAL_FLAGS]
    try:
        deployment = Deployment(**{name: getattr(args, name) for name in names})
    except ValueError as error:
        print(f"meshserve k8s render: error: {error}", file=sys.stderr)
        return 2
    text = to_yaml(deployment)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m meshserve.deploy.k8s --write-examples``: regenerate ``k8s/*.yaml``."""
    parser = argparse.ArgumentParser(prog="python -m meshserve.deploy.k8s")
    parser.add_argument("--write-examples", action="store_true", required=True,
                        help=f"rewrite the example manifests in {EXAMPLES_DIR}")
    parser.parse_args(argv)
    for path in write_examples():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
