"""``ServeSettings``: every knob of a deployment, from CLI flags or a serveConfigV2 ``args`` map.

A deployment is the engine every host runs (``EngineConfig``), where the hosts go
(``PlacementConfig``) and a few settings of the HTTP edge. All of it is named flat, the same way
on the command line (``--num-kv-blocks``) and in ``args`` (``num_kv_blocks``), and built through
``meshserve.config.from_flat``, so a new engine setting reaches both without being written here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshserve.config import EngineConfig, PlacementConfig, from_flat, setting

DEFAULT_API_KEY_ENV = "MESHSERVE_API_KEY"
OMP_WAIT_POLICIES = ("default", "passive", "active")


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineConfig = setting("the engine every host runs", default_factory=EngineConfig)
    placement: PlacementConfig = setting("where the host actors go",
                                         default_factory=PlacementConfig)
    served_model_name: str | None = setting(
        "the model name clients must send (default: the folder or file name)", None)
    max_queued_requests: int = setting(
        "sequences in flight on one engine replica before it answers 429", 512)
    ingress_replicas: int = setting(
        "HTTP ingress replicas; each validates, tokenizes and detokenizes its own requests", 1)
    omp_wait_policy: str = setting(
        "OpenMP wait policy of the hosts' engine threads: default (the OpenMP runtime's: a thread "
        "spins briefly between parallel regions, then sleeps), passive (it sleeps at once, "
        "leaving the core to other processes but waking late for the next region: 17% slower "
        "on 2 cores), or active (it spins, even while the engine is idle)", "default",
        choices=OMP_WAIT_POLICIES)
    reserved_cpus: int = setting(
        "CPUs of each host left to the serving processes (ingress, Ray, the engine replica): the "
        "host's engine is pinned to the others, one thread each, so those processes run beside "
        "it instead of preempting it. 0: the engine takes every CPU. It pays on many cores; on 2 "
        "it halves the engine (bench/README.md)", 0)
    edge_nice: int = setting(
        "niceness added to the ingress and engine-replica processes (0-19), on top of the 15 "
        "Ray starts every worker with (the host actors too; the sum stops at 19): where they "
        "share cores with the engines, the engines win", 10)
    max_body_bytes: int = setting("largest HTTP request body accepted, in bytes", 4 * 2**20)
    api_key: str | None = setting(
        f"require this bearer token on /v1 routes (or set {DEFAULT_API_KEY_ENV})", None)
    api_key_env: str | None = setting(
        f"environment variable that holds the API key (default {DEFAULT_API_KEY_ENV})", None)

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_body_bytes", "ingress_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ValueError(f"omp_wait_policy: must be one of {', '.join(OMP_WAIT_POLICIES)}, "
                             f"got {self.omp_wait_policy!r}")
        if not isinstance(self.reserved_cpus, int) or self.reserved_cpus < 0:
            raise ValueError(f"reserved_cpus: must be an integer >= 0, got {self.reserved_cpus!r}")
        if not isinstance(self.edge_nice, int) or not 0 <= self.edge_nice <= 19:
            raise ValueError(f"edge_nice: must be an integer in [0, 19], got {self.edge_nice!r}")

    def host_env(self) -> dict[str, str]:
        """Environment every host actor starts with (before its OpenMP runtime does)."""
        if self.omp_wait_policy == "default":
            return {}
        return {"OMP_WAIT_POLICY": self.omp_wait_policy.upper()}

    def lower_priority(self) -> None:
        """Make this (edge) process yield the CPU to the engines (``edge_nice``).

        Linux keeps a niceness per thread, and ``os.nice`` changes the caller's alone: every
        thread the process has now (Ray's event loop and I/O threads among them) is lowered, and
        threads started later inherit their starter's.
        """
        if not self.edge_nice:
            return
        try:
            threads = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:  # no procfs: the calling thread is all that can be reached
            os.nice(self.edge_nice)
            return
        for tid in threads:
            try:
                current = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, min(19, current + self.edge_nice))
            except ProcessLookupError:  # it ended meanwhile
                continue

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> "ServeSettings":
        """Build from a flat args map (serveConfigV2, ``serve run``, the CLI's flags); unknown
        keys are an error."""
        return from_flat(cls, dict(args or {}))

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        return os.environ.get(self.api_key_env or DEFAULT_API_KEY_ENV) or None

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from meshserve.runner.loader import default_model_path

        path = os.path.normpath(self.engine.model or default_model_path())
        name = os.path.basename(path)
        return name.removesuffix(".gguf")
