"""The Serve application's description: what ``build_app`` asks of Serve, before anything runs."""

from __future__ import annotations

import pytest
import ray

from meshserve.deploy.app import (LONE_REPLICA_STATS_PERIOD_S, ROUTING_STATS_PERIOD_S,
                                  engine_deployment)
from meshserve.deploy.routing import EngineRouter
from meshserve.deploy.settings import ServeSettings


def router_config(num_replicas: int):
    application = engine_deployment(ServeSettings.from_args({"num_replicas": num_replicas}))
    deployment = application._bound_deployment  # Serve keeps the description there (ray pinned)
    assert deployment._deployment_config.num_replicas == num_replicas
    return deployment._deployment_config.request_router_config


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_replicas_report_their_load_every_second_where_callers_choose(num_replicas: int) -> None:
    config = router_config(num_replicas)
    assert config.request_router_class.endswith(EngineRouter.__name__)
    assert config.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S == 1.0


def test_a_lone_replica_is_not_polled_for_load() -> None:
    config = router_config(1)
    assert config.request_router_class.endswith(EngineRouter.__name__)
    assert config.request_routing_stats_period_s == LONE_REPLICA_STATS_PERIOD_S >= 3600
    assert not ray.is_initialized()  # describing the application started nothing
