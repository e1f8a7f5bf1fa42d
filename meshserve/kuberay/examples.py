"""The example manifests committed in the repository's ``k8s/`` folder, and how to rewrite them.

A test keeps the committed files equal to ``to_yaml`` of these deployments; regenerate them from a
source checkout with ``meshserve k8s write-examples k8s``.
"""

from __future__ import annotations

from pathlib import Path

from meshserve.kuberay.deployment import Deployment
from meshserve.kuberay.manifest import to_yaml

EXAMPLES: dict[str, Deployment] = {
    "v5e-2x4-single-host.yaml": Deployment("v5e", "2x4", "/models/Llama-3.1-8B-Instruct"),
    "v6e-4x4-multi-host.yaml": Deployment("v6e", "4x4", "/models/Llama-3.3-70B-Instruct"),
    "v6e-2x4-data-parallel.yaml": Deployment("v6e", "2x4", "/models/Qwen2.5-32B-Instruct",
                                             replicas=2),
}


def write_examples(directory: Path) -> list[Path]:
    """Write every example manifest into ``directory``; returns the paths written."""
    paths = []
    for filename, deployment in EXAMPLES.items():
        path = directory / filename
        path.write_text(to_yaml(deployment))
        paths.append(path)
    return paths
