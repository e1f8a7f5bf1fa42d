"""The Ray Serve application builder: ``meshserve.deploy.app:build_app``.

Usable three ways with the same arguments: ``meshserve serve`` (the CLI), ``serve run
meshserve.deploy.app:build_app model=/path ...``, and a KubeRay ``serveConfigV2`` whose
application has ``import_path: meshserve.deploy.app:build_app`` and an ``args`` map. Building
only describes the deployments (and reads the cluster's nodes, when connected, to decide where the
engine replicas go); nothing loads weights until Serve runs it.

Two deployments: ``OpenAIIngress`` (``ingress_replicas`` replicas: HTTP, tokenizer, text) and
``Engine`` (``num_replicas`` engine replicas, each owning its hosts' placement group). Every handle
to ``Engine`` routes with ``EngineRouter``, inside the caller's process. HTTP reaches the ingress
through Serve's proxy, or, given ``listen`` (``meshserve serve``), straight from the kernel: every
ingress replica, all of them on the head node, listens on that address itself.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from meshserve.deploy.engine import RETIRE_S, EngineReplica
from meshserve.deploy.engine_placement import engine_placement
from meshserve.deploy.ingress import INGRESS_ACTOR_OPTIONS, OpenAIIngress
from meshserve.deploy.routing import EngineRouter
from meshserve.deploy.settings import ServeSettings

ENGINE_DEPLOYMENT = "Engine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
ROUTING_STATS_PERIOD_S = 1.0  # how fresh every caller's view of other callers' load is
# A lone engine replica leaves its callers no choice, so its load reports would inform no one, yet
# each is a controller call into the replica and its lead and a broadcast to every caller: without
# them an idle server took 6.5% of a core instead of 7.3% (bench/README.md). Serve wants a period,
# so it gets one that never comes round in practice.
LONE_REPLICA_STATS_PERIOD_S = 3600.0
# A resource only the head node has (Ray's own name for it): listening ingress replicas go where
# Serve's proxy would have listened (``proxy_location="HeadOnly"``), at no cost to the node.
HEAD_NODE = {"node:__internal_head__": 0.001}


def engine_deployment(settings: ServeSettings) -> Application:
    """The ``Engine`` deployment of ``settings``, bound (usable alone from Ray programs)."""
    placement = engine_placement(settings.placement)
    period = (ROUTING_STATS_PERIOD_S if settings.placement.num_replicas > 1
              else LONE_REPLICA_STATS_PERIOD_S)
    router = RequestRouterConfig(
        request_router_class=EngineRouter,
        request_router_kwargs={"block_size": settings.engine.cache.block_size},
        request_routing_stats_period_s=period)
    deployment = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=settings.placement.num_replicas,
        # Every caller holds one long-lived output stream per replica; admission is
        # max_queued_requests, counted in sequences by the replica itself.
        max_ongoing_requests=100_000, request_router_config=router,
        # Loading may compile for minutes; a constructor that fails is a setting to fix.
        max_constructor_retry_count=1,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=RETIRE_S + 5,
        **placement.deployment_options())
    return deployment.bind(settings, placement)


def build_app(args: dict | ServeSettings | None = None) -> Application:
    """The ingress → engines application for ``ServeSettings.from_args(args)``, behind Serve's
    proxy: the builder that ``serve run`` and KubeRay's ``serveConfigV2`` import, which Serve
    calls with the ``args`` map alone (it refuses a builder of more than one parameter)."""
    settings = args if isinstance(args, ServeSettings) else ServeSettings.from_args(args)
    return application(settings)


def application(settings: ServeSettings, listen: tuple[str, int] | None = None) -> Application:
    """The ingress → engines application of ``settings``.

    ``listen``: ``(host, port)`` on which every ingress replica serves HTTP itself (start Serve
    with ``proxy_location="Disabled"`` then; ``meshserve serve`` does); None: Serve's proxy
    serves it.
    """
    placed = {} if listen is None else {"resources": HEAD_NODE}
    ingress = OpenAIIngress.options(num_replicas=settings.ingress_replicas,
                                    ray_actor_options={**INGRESS_ACTOR_OPTIONS, **placed})
    return ingress.bind(engine_deployment(settings), settings, listen)
