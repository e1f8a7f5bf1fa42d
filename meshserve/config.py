"""Frozen, self-validating configuration dataclasses.

Every user-facing knob lands in exactly one of these; each validates itself in ``__post_init__``
and raises ``ValueError`` naming the offending field, so a bad flag fails at start-up, not in the
middle of serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, independent of where its weights came from."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # Mistral; None means full attention

    def __post_init__(self) -> None:
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES,
            "architecture",
            f"{self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, "must be positive")
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots per layer."""

    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory by the engine
    enable_prefix_caching: bool = True
    # Fraction of available host memory the KV cache may take when num_blocks is None.
    memory_fraction: float = 0.1

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", f"must be a positive power of two, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 2, "num_kv_blocks",
                 f"must be at least 2 (one is reserved for padding), got {self.num_blocks}")
        _require(0.0 < self.memory_fraction <= 1.0, "memory_fraction", "must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits: a per-step token budget and a cap on running sequences."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own maximum, capped at what the KV cache can hold.
    max_model_len: int | None = None
    # Token buckets grow by this gap once they reach it (0: keep doubling). See runner/buckets.py.
    bucket_gap: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be at least 1")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 "must be at least 2")
        _require(self.bucket_gap >= 0, "bucket_gap", "must be non-negative")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one replica's chips are arranged: a mesh of (data, model) axes."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        _require(self.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How many host actors a deployment starts and what each reserves from Ray."""

    num_replicas: int = 1  # data-parallel copies of the model, each behind the one router
    hosts_per_replica: int = 1  # on a TPU slice: the slice's host count
    # CPUs each host actor reserves (on a TPU slice it also reserves its host's chips).
    host_num_cpus: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_replicas", "hosts_per_replica"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name,
                     f"must be an integer >= 1, got {value!r}")
        _require(self.host_num_cpus > 0, "host_num_cpus", "must be positive")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine needs; built by ``LLM`` and by the host actors from the same flags."""

    model: str | None = None  # a Hugging Face folder, a .gguf file, or None for the bundled model
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile_cache_dir: str | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in SUPPORTED_DTYPES, "dtype",
                 f"{self.dtype!r} is not one of {', '.join(SUPPORTED_DTYPES)}")
        _require(self.device in ("auto", "cpu", "xla"), "device",
                 f"{self.device!r} is not one of auto, cpu, xla")

    def replace(self, **changes: Any) -> "EngineConfig":
        from dataclasses import replace

        return replace(self, **changes)
