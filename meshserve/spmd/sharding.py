"""Where every tensor lives on the mesh: partition specs for the weights, KV cache and inputs.

The Megatron split over the ``model`` axis, applied to an unchanged model (gpt-fast's ``tp.py``
idea): q/k/v/gate/up are split by output columns, o/down by input rows (so each layer needs one
all-reduce after attention and one after the MLP), embedding and lm_head by vocabulary. The KV
cache ``[blocks, block_size, kv_heads, head_dim]`` is split by KV heads. Tokens of a step are split
over the ``data`` axis. A spec is a tuple with one mesh axis name (or None) per tensor dimension;
nn.Linear weights are ``[out_features, in_features]``.

Every shard must hold whole heads. Query heads must divide evenly over the model axis; when the
model has fewer KV heads than a shard count that fits (or a count that does not divide evenly),
each KV head is repeated so the cache holds ``lcm(kv_heads, tp)`` heads, and query head ``i`` still
reads a copy of its own KV head on its own shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from meshserve.config import ModelConfig
from meshserve.spmd.mesh import DATA_AXIS, MODEL_AXIS, axis_size

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh

PartitionSpec = tuple[str | None, ...]

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")
KV_CACHE_SPEC: PartitionSpec = (None, None, MODEL_AXIS, None)


def valid_tensor_parallel_sizes(config: ModelConfig) -> list[int]:
    """Shard counts that give every shard whole query heads (KV heads are repeated to fit)."""
    heads = config.num_attention_heads
    return [size for size in range(1, heads + 1) if heads % size == 0]


def kv_head_copies(config: ModelConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head a model axis of this size needs; raises if none fits."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    valid = valid_tensor_parallel_sizes(config)
    if tensor_parallel_size not in valid:
        raise ValueError(
            f"tensor_parallel_size: {tensor_parallel_size} does not split {heads} attention heads "
            f"({kv_heads} KV heads) into whole heads per shard; valid sizes: "
            f"{', '.join(map(str, valid))}")
    return math.lcm(kv_heads, tensor_parallel_size) // kv_heads


def weight_spec(name: str, ndim: int) -> PartitionSpec:
    """The partition spec of a parameter, by its Hugging Face name."""
    module = name.split(".")[-2]
    if module in _COLUMN_PARALLEL or module in _VOCAB_PARALLEL:
        return (MODEL_AXIS,) + (None,) * (ndim - 1)  # weight rows = outputs (or vocab), bias
    if module in _ROW_PARALLEL and ndim == 2:
        return (None, MODEL_AXIS)
    return (None,) * ndim  # norms: replicated


def token_spec(ndim: int) -> PartitionSpec:
    """Token-major step inputs (ids, positions, slots, per-token tables): split over data."""
    return (DATA_AXIS,) + (None,) * (ndim - 1)


@dataclass(frozen=True)
class ShardingPlan:
    """How one model is laid out on one mesh (``mesh=None``: a single device, nothing split)."""

    mesh: "Mesh | None"
    config: ModelConfig  # the model as the mesh sees it: KV heads repeated where needed
    kv_copies: int

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    def weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's weights with every KV head's k/v rows repeated ``kv_copies`` times."""
        if self.kv_copies == 1:
            return weights
        head_dim = self.config.head_dim
        out = dict(weights)
        for name, tensor in weights.items():
            if name.split(".")[-2] in ("k_proj", "v_proj"):
                heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])  # [Hkv, D, (in)]
                out[name] = heads.repeat_interleave(self.kv_copies, dim=0).flatten(0, 1)
        return out


def plan_sharding(config: ModelConfig, mesh: "Mesh | None") -> ShardingPlan:
    copies = kv_head_copies(config, axis_size(mesh, MODEL_AXIS))
    kv_heads = config.num_key_value_heads * copies
    return ShardingPlan(mesh, replace(config, num_key_value_heads=kv_heads), copies)
