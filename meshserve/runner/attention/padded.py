"""Attention for XLA without Pallas (e.g. the PJRT CPU client): static shapes, one graph per bucket.

Every token attends over its request's block-table row, masked by position. The row is cut to a
context bucket (``context_buckets``: 4, 16, 64, ... blocks) that covers the step's longest
request, so the forward has one graph per (token bucket, context bucket) and a step costs tokens x
its bucket's keys per layer, not tokens x max_model_len: the gather of those keys is most of a
small model's step on XLA:CPU. A correct, compilable path for machines without a TPU, not a fast
one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshserve.runner.attention.base import (AttentionBackend, AttentionMetadata, KVCache,
                                             StepLayout, ToDevice)
from meshserve.runner import buckets


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> KVCache:
    """The caches with new keys/values ``[num_tokens, kv_heads, head_dim]`` at their slots.

    Out of place: XLA updates the cache by donating the old buffer to the new one (see
    ``Backend.donate``), and a compiled piece that returns its caches leaves nothing for
    torch_xla's dynamo bridge to copy back into its inputs (an in-place write would: a pending
    resharding copy of the whole cache after every step under SPMD)."""
    blocks, block_size, heads, dim = k_cache.shape
    flat = (blocks * block_size, heads, dim)
    return (k_cache.view(flat).index_copy(0, slot_mapping, key).view(k_cache.shape),
            v_cache.view(flat).index_copy(0, slot_mapping, value).view(v_cache.shape))


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: a query at ``q_pos`` sees keys up to its own position."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def attend_paged_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, q_pos: torch.Tensor, scale: float,
                      window: int | None) -> torch.Tensor:
    """Each query row ``[N, H, D]`` against the context its block-table row ``[N, B]`` names.

    ``q_pos`` ``[N]`` is each query's position; keys past it are masked. Returns ``[N, H, D]``.
    """
    rows, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    q = query.view(rows, kv_heads, num_heads // kv_heads, head_dim)  # [N, Hkv, G, D]
    keys = k_cache[block_tables].flatten(1, 2)  # [N, L, Hkv, D]
    values = v_cache[block_tables].flatten(1, 2)
    scores = torch.einsum("nhgd,nlhd->nhgl", q, keys).float() * scale  # [N, Hkv, G, L]
    k_pos = torch.arange(keys.shape[1], device=query.device)
    allowed = allowed_keys(q_pos[:, None], k_pos[None, :], window)  # [N, L]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.einsum("nhgl,nlhd->nhgd", probs, values).reshape(rows, num_heads, head_dim)


@dataclass(frozen=True, slots=True)
class PaddedMetadata(AttentionMetadata):
    positions: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [T, max_blocks] the block-table row of each token's request


@dataclass(frozen=True)
class PaddedAttention(AttentionBackend):
    sliding_window: int | None

    def context_buckets(self, max_blocks: int) -> list[int]:
        return buckets.context_buckets(max_blocks)

    def metadata(self, layout: StepLayout, to_device: ToDevice) -> PaddedMetadata:
        tables = np.zeros((len(layout.positions), layout.block_table.shape[1]), dtype=np.int64)
        tables[:layout.num_tokens] = layout.block_table[layout.token_rows]  # padding: null block
        return PaddedMetadata(to_device(layout.slot_mapping, True),
                              to_device(layout.positions, True), to_device(tables, True))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, meta: PaddedMetadata,
                scale: float) -> tuple[torch.Tensor, KVCache]:
        k_cache, v_cache = write_kv(*kv_cache, key, value, meta.slot_mapping)
        out = attend_paged_rows(query, k_cache, v_cache, meta.block_tables, meta.positions,
                                scale, self.sliding_window)
        return out, (k_cache, v_cache)


