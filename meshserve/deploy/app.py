"""The Ray Serve application builder: ``meshserve.deploy.app:build_app``.

Usable three ways with the same arguments: ``meshserve serve`` (the CLI), ``serve run
meshserve.deploy.app:build_app model=/path ...``, and a KubeRay ``serveConfigV2`` whose
application has ``import_path: meshserve.deploy.app:build_app`` and an ``args`` map. Building
only describes the deployments; nothing loads weights or starts Ray until Serve runs it.
"""

from __future__ import annotations

from ray.serve import Application

from meshserve.deploy.ingress import OpenAIIngress
from meshserve.deploy.router import RouterDeployment
from meshserve.deploy.settings import ServeSettings


def build_app(args: dict | None = None) -> Application:
    """The ingress → router → host actors application for ``ServeSettings.from_args(args)``."""
    settings = args if isinstance(args, ServeSettings) else ServeSettings.from_args(args)
    router = RouterDeployment.bind(settings)
    return OpenAIIngress.bind(router, settings)
