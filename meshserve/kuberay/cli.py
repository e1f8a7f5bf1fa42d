"""``meshserve k8s render`` and ``meshserve k8s write-examples``: flags and handlers.

Registering the flags loads only the deployment's fields and the TPU table; the renderer (and
YAML) loads when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshserve.kuberay.deployment import (API_KEY_ENV, CACHE_MOUNT, DEFAULTS, OPTIONAL_FLAGS,
                                          WEIGHTS_MOUNT, Deployment)
from meshserve.kuberay.tpu import GENERATIONS


def add_k8s_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``k8s render`` and ``k8s write-examples``; the handler is ``args.func(args)``."""
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
    for field, flag in OPTIONAL_FLAGS:
        default = DEFAULTS[field]
        kind = int if isinstance(default, int) else str
        render_parser.add_argument(flag, dest=field, type=kind, default=default,
                                   help=helps.get(field, f"engine limit (default {default})"))
    render_parser.add_argument("--output", "-o", default="-",
                               help="file to write (default: standard output)")
    render_parser.set_defaults(func=_run_render)
    examples_parser = commands.add_parser(
        "write-examples", help="rewrite the example manifests (k8s/ in a source checkout)")
    examples_parser.add_argument("directory", type=Path, help="folder to write them into")
    examples_parser.set_defaults(func=_run_write_examples)
    return k8s


def _run_render(args: argparse.Namespace) -> int:
    from meshserve.kuberay.manifest import to_yaml

    names = ["accelerator", "topology", "model"] + [field for field, _ in OPTIONAL_FLAGS]
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


def _run_write_examples(args: argparse.Namespace) -> int:
    from meshserve.kuberay.examples import write_examples

    if not args.directory.is_dir():
        print(f"meshserve k8s write-examples: error: {args.directory} is not a folder",
              file=sys.stderr)
        return 2
    for path in write_examples(args.directory):
        print(path)
    return 0
