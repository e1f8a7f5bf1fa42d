"""Frozen, self-validating configuration dataclasses, and the one way to build them from flat names.

Every user-facing knob lands in exactly one of these, with its default and its help text (in the
field's metadata); each dataclass validates itself in ``__post_init__`` and raises ``ValueError``
naming the offending field, so a bad flag fails at start-up, not in the middle of serving.

Users name settings flat (``block_size``, ``max_num_seqs``), whether as ``LLM(**kwargs)``, CLI flags
or a serveConfigV2 ``args`` map. ``flat_settings`` lists a dataclass's settings with those of its
nested config dataclasses expanded in place, and ``from_flat`` builds it back from such a mapping:
the CLI generates its flags from the first, and ``LLM``, the CLI and the Serve app all build with
the second, so a default or a help text is written once, here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SUPPORTED_DEVICES = ("auto", "cpu", "xla")
GENERATION_CONFIGS = ("auto", "vllm")

Config = TypeVar("Config")


def setting(help: str, default: Any = MISSING, *, default_factory: Any = MISSING,
            choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that carries its help text (and allowed values) in its metadata."""
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, "choices": choices})


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, independent of where its weights came from."""

    architecture: str = setting("model family", choices=SUPPORTED_ARCHITECTURES)
    vocab_size: int = setting("tokens in the vocabulary")
    hidden_size: int = setting("width of the residual stream")
    intermediate_size: int = setting("width of the MLP")
    num_hidden_layers: int = setting("decoder layers")
    num_attention_heads: int = setting("query heads")
    num_key_value_heads: int = setting("key/value heads (fewer than query heads: GQA)")
    head_dim: int = setting("width of one attention head")
    rms_norm_eps: float = setting("epsilon of the RMS norms")
    max_position_embeddings: int = setting("longest context the model was trained for")
    tie_word_embeddings: bool = setting("the lm_head reuses the embedding matrix")
    attention_bias: bool = setting("q/k/v projections carry a bias (Qwen2)")
    bos_token_id: int | None = setting("beginning-of-sequence token, if any")
    eos_token_ids: tuple[int, ...] = setting("tokens that end a sequence")
    sliding_window: int | None = setting("attention window (Mistral); None: full attention",
                                         None)

    def __post_init__(self) -> None:
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES,
            "architecture",
            f"{self.architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, "must be positive")
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"{self.num_key_value_heads} does not divide "
            f"num_attention_heads={self.num_attention_heads}",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: ``num_kv_blocks`` blocks of ``block_size`` token slots per layer."""

    block_size: int = setting("token slots per KV block (a power of two)", 16)
    num_kv_blocks: int | None = setting(
        "KV blocks per engine, one of them reserved for padding (default: sized from free memory; "
        "set it for multi-host replicas so every host allocates the same cache)", None)
    enable_prefix_caching: bool = setting(
        "share the KV blocks of prompts that start alike", True)
    memory_fraction: float = setting(
        "fraction of available host memory the KV cache may take when num_kv_blocks is unset",
        0.1)
    device_memory_fraction: float = setting(
        "fraction of an accelerator's free memory (TPU HBM, after the weights) the KV cache may "
        "take when num_kv_blocks is unset", 0.9)

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", f"must be a positive power of two, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
                 f"must be at least 2 (one is reserved for padding), got {self.num_kv_blocks}")
        _require(0.0 < self.memory_fraction <= 1.0, "memory_fraction", "must be in (0, 1]")
        _require(0.0 < self.device_memory_fraction <= 1.0, "device_memory_fraction",
                 "must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits: a per-step token budget and a cap on running sequences."""

    max_num_seqs: int = setting("sequences an engine runs at once", 64)
    max_num_batched_tokens: int | None = setting(
        "tokens an engine computes per step (default: 2048 on the cpu device, as vLLM's CPU "
        "server; 1024 on xla, where warm-up compiles every token bucket up to it)", None)
    max_model_len: int | None = setting(
        "longest sequence, prompt included (default: the model's own, capped at what the KV "
        "cache holds)", None)
    bucket_gap: int = setting(
        "token buckets double up to this size, then grow by it (0: keep doubling); fewer "
        "compiled shapes on xla", 0)

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", "must be at least 1")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 "must be at least 2")
        _require(self.bucket_gap >= 0, "bucket_gap", "must be non-negative")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one replica's chips are arranged: a mesh of (data, model) axes."""

    tensor_parallel_size: int = setting("chips a model is sharded over (the mesh's model axis)",
                                        1)
    data_parallel_size: int = setting(
        "copies of the model inside one replica's mesh (the mesh's data axis)", 1)
    step_deadline_s: float = setting(
        "seconds a host of a multi-host replica may take to answer a step; a host later than "
        "that (hung or frozen) fails the replica", 30.0)

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        _require(self.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")
        _require(self.step_deadline_s > 0, "step_deadline_s", "must be positive")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How many host actors a deployment starts and what each reserves from Ray."""

    num_replicas: int = setting("data-parallel replicas behind the router", 1)
    hosts_per_replica: int = setting(
        "hosts one replica spans (on a TPU slice: the slice's host count)", 1)
    host_num_cpus: float = setting(
        "CPUs each host actor reserves in Ray (on a TPU slice it also reserves its host's chips)",
        1.0)

    def __post_init__(self) -> None:
        for name in ("num_replicas", "hosts_per_replica"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name,
                     f"must be an integer >= 1, got {value!r}")
        _require(self.host_num_cpus > 0, "host_num_cpus", "must be positive")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine needs; ``LLM``, the CLI and the Serve app build it with
    ``EngineConfig.from_flat``."""

    model: str | None = setting(
        "Hugging Face folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)", None)
    generation_config: str = setting(
        "sampling defaults for requests that leave a field unset; auto: the model's own "
        "(generation_config.json, or GGUF general.sampling.* metadata); vllm: the neutral ones "
        "(temperature 1, top_p 1, no top_k), as vLLM's --generation-config", "auto",
        choices=GENERATION_CONFIGS)
    dtype: str = setting("weights and activations; auto: what the device computes natively "
                         "(bfloat16 on a TPU or a CPU with AVX512-BF16/AMX, else float32)", "auto",
                         choices=SUPPORTED_DTYPES)
    device: str = setting("cpu: torch, the step compiled by inductor; xla: torch_xla (a TPU, else "
                          "PJRT CPU); auto: xla on a TPU host", "auto", choices=SUPPORTED_DEVICES)
    seed: int = setting("seed of unseeded sampling (equal on every host of a replica)", 0)
    cache: CacheConfig = setting("the paged KV cache", default_factory=CacheConfig)
    scheduler: SchedulerConfig = setting("batching limits", default_factory=SchedulerConfig)
    parallel: ParallelConfig = setting("the device mesh", default_factory=ParallelConfig)
    compile_cache_dir: str | None = setting(
        "folder for compiled programs: inductor's caches and the CPU kernels (cpu device), "
        "torch_xla's persistent cache (xla device)", None)
    enforce_eager: bool = setting(
        "run the step without torch.compile (eager torch on cpu, lazy tracing on xla): slower, "
        "for debugging", False)

    def __post_init__(self) -> None:
        _require(self.dtype in SUPPORTED_DTYPES, "dtype",
                 f"{self.dtype!r} is not one of {', '.join(SUPPORTED_DTYPES)}")
        _require(self.device in SUPPORTED_DEVICES, "device",
                 f"{self.device!r} is not one of {', '.join(SUPPORTED_DEVICES)}")
        _require(self.generation_config in GENERATION_CONFIGS, "generation_config",
                 f"{self.generation_config!r} is not one of {', '.join(GENERATION_CONFIGS)}")

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """Build from flat names (``model``, ``block_size``, ``max_num_seqs``...)."""
        return from_flat(cls, values)

    def to_flat(self) -> dict[str, Any]:
        """The flat names and values ``from_flat`` takes back."""
        return to_flat(self)


# --- Flat names -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlatSetting:
    """One leaf field of a config dataclass, as a flag or an ``args`` key sees it."""

    name: str
    kind: type  # int, float, bool or str
    optional: bool  # None is allowed
    default: Any
    help: str
    choices: tuple[str, ...] | None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def flat_settings(cls: type) -> list[FlatSetting]:
    """``cls``'s fields in order, each nested config dataclass replaced by its own fields."""
    out: list[FlatSetting] = []
    hints = _hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if _is_section(hint):
            out.extend(flat_settings(hint))
            continue
        args = typing.get_args(hint)
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2 \
            and type(None) in args
        kind = next(a for a in args if a is not type(None)) if optional else hint
        if kind not in (int, float, bool, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a flat setting must be a scalar or an "
                            f"optional scalar, not {hint}")
        out.append(FlatSetting(f.name, kind, optional, f.default, f.metadata["help"],
                               f.metadata["choices"]))
    return out


def from_flat(cls: type[Config], values: Mapping[str, Any]) -> Config:
    """Build ``cls`` (and its nested config dataclasses) from flat names; names left out keep
    their defaults. An unknown name or a value of the wrong type raises ``ValueError``."""
    known = {s.name: s for s in flat_settings(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    for name, value in values.items():
        _check_type(known[name], value)
    return _build(cls, values)


def _check_type(s: FlatSetting, value: Any) -> None:
    if value is None:
        ok = s.optional
    elif isinstance(value, bool):  # bool is an int to Python, never to a user
        ok = s.kind is bool
    else:
        ok = isinstance(value, s.kind) or (s.kind is float and isinstance(value, int))
    _require(ok, s.name, f"expected {s.kind.__name__}{' or None' if s.optional else ''}, "
                         f"got {value!r}")


def _build(cls: type[Config], values: Mapping[str, Any]) -> Config:
    hints = _hints(cls)
    kwargs = {}
    for f in fields(cls):
        if _is_section(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def to_flat(config: Any) -> dict[str, Any]:
    """A config dataclass's leaf values under their flat names (the inverse of ``from_flat``)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        out.update(to_flat(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out
