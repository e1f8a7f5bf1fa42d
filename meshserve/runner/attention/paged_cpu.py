"""The cpu backend's attention: meshserve's C++ paged attention kernel, one opaque op per layer.

``runner/kernels/paged_attention.cpp`` writes the step's keys and values into the cache and
attends every token over its sequence's blocks in place, for any mix of prefills and decodes;
the layer names its cache by an id (see ``runner/kernels/ops.py``), so a compiled forward never
takes the cache as an input.

Sizes are dynamic on cpu (one compiled program for every step), but a size of 1 is a special case
to torch.compile, so a step is padded to at least two tokens and two sequences: a padding token
writes into the null block and belongs to no sequence; a padding sequence has no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshserve.runner.attention.base import (AttentionBackend, AttentionMetadata, KVCache,
                                             StepLayout, ToDevice)
from meshserve.runner.kernels.ops import layer_attention, register_kv_cache

MIN_SIZE = 2  # tokens and sequences a step is padded to, so neither size is ever 1


@dataclass(frozen=True, slots=True)
class PagedCpuMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int64
    seq_lens: torch.Tensor  # [S] int64 context of each sequence, this step's tokens included


@dataclass(frozen=True)
class PagedCpuAttention(AttentionBackend):
    sliding_window: int | None
    writes_in_place = True

    def cache_shapes(self, num_blocks: int, block_size: int, kv_heads: int,
                     head_dim: int) -> list[tuple[int, ...]]:
        # Keys transposed within a block, so the kernel scores 16 keys per vector instruction.
        # bf16 on a CPU with AMX keeps the same shapes but pairs each block's memory for the tile
        # instructions (``kernels.ops.paired_blocks``).
        return [(num_blocks, kv_heads, head_dim, block_size),
                (num_blocks, kv_heads, block_size, head_dim)]

    def bind_cache(self, cache: KVCache) -> int:
        return register_kv_cache(*cache)

    def metadata(self, layout: StepLayout, to_device: ToDevice) -> PagedCpuMetadata:
        rows = len(layout.seq_lens)
        pad = max(MIN_SIZE - rows, 0)
        starts, seq_lens, tables = layout.query_start_loc, layout.seq_lens, layout.block_table
        if pad:
            starts = np.concatenate([starts, np.full(pad, starts[-1], dtype=starts.dtype)])
            seq_lens = np.concatenate([seq_lens, np.zeros(pad, dtype=seq_lens.dtype)])
            tables = np.concatenate([tables, np.zeros((pad, tables.shape[1]), tables.dtype)])
        return PagedCpuMetadata(to_device(layout.slot_mapping, True), to_device(tables, False),
                                to_device(starts, False), to_device(seq_lens, False))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: int, meta: PagedCpuMetadata, scale: float) -> tuple[torch.Tensor, int]:
        out = layer_attention(query, key, value, meta.slot_mapping, meta.block_tables,
                              meta.query_start_loc, meta.seq_lens, kv_cache, scale,
                              self.sliding_window or 0)
        return out, kv_cache  # written in place: the same cache
