"""torch_xla's ragged paged attention kernel: the TPU's attention (a seam: it runs only there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from meshserve.runner.attention.base import (AttentionBackend, AttentionMetadata, KVCache,
                                             StepLayout, ToDevice)
from meshserve.spmd.sharding import KV_CACHE_SPEC, MODEL_AXIS

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh


@dataclass(frozen=True, slots=True)
class PallasMetadata(AttentionMetadata):
    seq_lens: torch.Tensor  # [S] int32, S = max_num_seqs
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    num_seqs: torch.Tensor  # [1] int32


_TPU_LANES = 128  # the kernel's head_dim alignment; smaller heads are zero-padded
_Q_SPEC = (None, MODEL_AXIS, None)  # [T, H, D] split by heads, as the q projection leaves it


@dataclass(frozen=True)
class PallasAttention(AttentionBackend):
    """torch_xla's ragged paged attention kernel (TPU).

    Under SPMD the kernel runs inside a manual-sharding region: each chip attends its own heads
    (whole heads, see spmd/sharding.py) and no collective is needed.
    """

    sliding_window: int | None
    max_num_seqs: int
    mesh: "Mesh | None" = None
    use_kernel: bool = True  # False: torch_xla's reference loop, for checks without a TPU

    def cache_shapes(self, num_blocks: int, block_size: int, kv_heads: int,
                     head_dim: int) -> list[tuple[int, ...]]:
        # One tensor, keys and values interleaved on the head axis (k0, v0, k1, v1, ...).
        padded = -(-head_dim // _TPU_LANES) * _TPU_LANES
        return [(num_blocks, block_size, 2 * kv_heads, padded)]

    def metadata(self, layout: StepLayout, to_device: ToDevice) -> PallasMetadata:
        # Request arrays padded to max_num_seqs, not to the request bucket, so the forward graph
        # depends on the token bucket alone; num_seqs tells the kernel how many rows are real.
        n, s = len(layout.seq_lens), self.max_num_seqs
        seq_lens = np.zeros(s, dtype=np.int32)
        seq_lens[:n] = layout.seq_lens
        tables = np.zeros((s, layout.block_table.shape[1]), dtype=np.int32)
        tables[:n] = layout.block_table
        starts = np.full(s + 1, layout.num_tokens, dtype=np.int32)
        starts[:n + 1] = layout.query_start_loc
        return PallasMetadata(to_device(layout.slot_mapping, True), to_device(seq_lens, False),
                              to_device(tables, False), to_device(starts, False),
                              to_device(np.array([n], dtype=np.int32), False))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, meta: PallasMetadata,
                scale: float) -> tuple[torch.Tensor, KVCache]:
        from torch_xla.experimental.custom_kernel import ragged_paged_attention

        (cache,) = kv_cache
        tokens, num_heads, head_dim = query.shape
        pad = (0, cache.shape[-1] - head_dim)
        kv = torch.stack((F.pad(key, pad), F.pad(value, pad)), dim=2).flatten(1, 2)  # [T, 2Hkv, Dp]
        # Out of place, as in padded.py's write_kv: the old buffer is donated to the new one.
        cache = cache.view(-1, *cache.shape[2:]).index_copy(0, meta.slot_mapping, kv).view(
            cache.shape)
        query = F.pad(query, pad)
        q, pages = query, cache
        if self.mesh is not None:
            import torch_xla.distributed.spmd as xs

            q = xs.enable_manual_sharding(query, _Q_SPEC, mesh=self.mesh).global_tensor
            pages = xs.enable_manual_sharding(cache, KV_CACHE_SPEC, mesh=self.mesh).global_tensor
        out = ragged_paged_attention(q, pages, meta.seq_lens, meta.block_tables,
                                     meta.query_start_loc, meta.num_seqs, sm_scale=scale,
                                     sliding_window=self.sliding_window, use_kernel=self.use_kernel)
        if self.mesh is not None:
            out = xs.disable_manual_sharding(out, _Q_SPEC, query.shape,
                                             mesh=self.mesh).global_tensor
        return out[..., :head_dim], (cache,)


