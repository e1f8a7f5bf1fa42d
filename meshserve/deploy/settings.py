"""``ServeSettings``: every knob of a deployment, from CLI flags or a serveConfigV2 ``args`` map."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from meshserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig


@dataclass(frozen=True)
class ServeSettings:
    model: str | None = None  # a Hugging Face folder, a .gguf file, or None: the bundled model
    served_model_name: str | None = None  # default: the folder or file name
    device: str = "auto"
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    hosts_per_replica: int = 1
    num_replicas: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    compile_cache_dir: str | None = None
    seed: int = 0
    # CPUs each host actor reserves from Ray (on a TPU slice it also reserves its host's chips).
    host_num_cpus: float = 1.0
    max_queued_requests: int = 512  # past this the router answers 429
    max_body_bytes: int = 4 * 2**20
    api_key: str | None = None
    api_key_env: str | None = None  # name of an environment variable holding the API key

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "hosts_per_replica", "num_replicas", "max_num_seqs",
                     "max_num_batched_tokens", "max_queued_requests", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        self.engine_config()  # validates the engine's part

    @classmethod
    def from_args(cls, args: dict | None) -> "ServeSettings":
        """Build from an args map (serveConfigV2 / ``serve run``); unknown keys are an error."""
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**args)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, seed=self.seed,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_kv_blocks,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            compile_cache_dir=self.compile_cache_dir)

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        name = self.api_key_env or "MESHSERVE_API_KEY"
        return os.environ.get(name) or None

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from meshserve.runner.loader import default_model_path

        path = os.path.normpath(self.model or default_model_path())
        name = os.path.basename(path)
        return name.removesuffix(".gguf")
