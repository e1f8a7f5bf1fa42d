"""What to deploy: the few choices a RayService for meshserve is rendered from, validated.

Kept apart from the renderer (and its YAML) so that the CLI can register its flags from these
fields and defaults without loading anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from meshserve.deploy.settings import DEFAULT_API_KEY_ENV
from meshserve.kuberay.tpu import TpuSlice, resolve_slice

# Placeholders that work as strings but point nowhere: render with --image/--bucket for real use.
DEFAULT_IMAGE = "us-docker.pkg.dev/my-project/meshserve/meshserve-tpu:0.1.0"
DEFAULT_BUCKET = "my-project-meshserve"
# Inside the pods: where the bucket's folders are mounted, and the API key's variable.
WEIGHTS_MOUNT = "/models"
CACHE_MOUNT = "/xla-cache"
API_KEY_ENV = DEFAULT_API_KEY_ENV
# KubeRay rejects longer RayService names: the RayCluster it creates adds a 6-character suffix,
# and "<cluster>-serve-svc" must still fit in a 63-character DNS label.
MAX_NAME_LENGTH = 47
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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


DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Deployment)}

# Deployment field -> flag, for the optional flags (shared by the parser and command_line).
OPTIONAL_FLAGS = (
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
