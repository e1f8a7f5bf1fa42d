"""``EngineHost``: what every host actor does, lead or follower: claim its cores, build the
engine, describe it."""

from __future__ import annotations

import os

from meshserve.actors.cpus import claim_engine_cpus
from meshserve.actors.messages import HostInfo
from meshserve.config import EngineConfig
from meshserve.engine.engine import EngineCore
from meshserve.logs import configure_process_logging

# The TPU runtime variables a host may be started with (see placement.py); reported in HostInfo.
TPU_ENV_VARS = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES")


class EngineHost:
    """Builds one engine on this host; ``HostActor`` (lead) and ``FollowerHost`` extend it.
    ``reserved_cpus``: the CPUs it leaves to the serving processes (``actors/cpus.py``); build it
    on the thread that will step the engine."""

    def __init__(self, config: EngineConfig, host_index: int = 0, reserved_cpus: int = 0, *,
                 allocate: bool = True) -> None:
        import ray

        configure_process_logging()  # before the engine's imports and builds log anything
        self.engine_cpus = claim_engine_cpus(reserved_cpus)
        # allocate=False: weights only; a multi-host replica sizes its cache by agreement first.
        self.engine = EngineCore(config, allocate=allocate)
        self.host_index = host_index
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self) -> HostInfo:
        e = self.engine
        tpu_env = {name: os.environ[name] for name in TPU_ENV_VARS if name in os.environ}
        return HostInfo(self.node_id, self.host_index, e.loaded.name, e.max_model_len,
                        e.loaded.config.vocab_size, e.block_manager.num_total_blocks,
                        e.config.cache.block_size, tpu_env, os.getpid(), self.engine_cpus)
