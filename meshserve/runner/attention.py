"""Paged attention over a flat batch of tokens that mixes prefills and decodes.

The KV cache of one layer is a tuple of tensors whose layout the implementation chooses; new keys
and values are written through a slot mapping (one flat cache slot per token), and queries read
each request's context back through its row of the block table, so a request's KV never needs to
be contiguous.

Three implementations; ``select_attention`` is the one place that picks:

- ``TorchAttention`` (the cpu backend): decodes batched, each prefill with its own shapes. Fastest
  where shapes cost nothing.
- ``PaddedAttention`` (XLA without Pallas, e.g. the PJRT CPU client): static shapes. Every token
  attends over its request's whole block-table row, masked by position, so the graph depends on the
  token bucket only. It costs tokens x max_model_len keys per layer: a correct, compilable path for
  machines without a TPU, not a fast one.
- ``PallasAttention`` (TPU): torch_xla's ragged paged attention kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from meshserve.config import ModelConfig
from meshserve.spmd.sharding import KV_CACHE_SPEC, MODEL_AXIS

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh

    from meshserve.spmd.backend import Backend

KVCache = tuple[torch.Tensor, ...]
# Copies a CPU array to the device; the flag says it is token-major (split over the data axis).
ToDevice = Callable[[np.ndarray, bool], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One step's batch as numpy arrays on the CPU, padded to the token bucket.

    Rows are the persistent batch's first ``n`` rows; padding tokens sit at position 0 and write
    into slot 0 of the null block, which no request owns.
    """

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64 flat cache slot of each token
    token_rows: np.ndarray  # [num_tokens] batch row of each real token
    query_start_loc: np.ndarray  # [n + 1] int64 first token of each row, then the total
    seq_lens: np.ndarray  # [n] int64 context length including this step's tokens
    block_table: np.ndarray  # [n, max_blocks] int32

    @property
    def num_tokens(self) -> int:
        return len(self.token_rows)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, kv_heads, head_dim]`` at their slots, in place."""
    blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(blocks * block_size, heads, dim).index_copy_(0, slot_mapping, key)
    v_cache.view(blocks * block_size, heads, dim).index_copy_(0, slot_mapping, value)


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
class AttentionMetadata:
    """The per-step tensors every layer's attention reads, on the device, built once per step by
    ``AttentionBackend.metadata``. Each implementation extends it with what its kernel needs."""

    slot_mapping: torch.Tensor  # [T] flat cache slot each token's new key/value is written to


class AttentionBackend(ABC):
    """How one implementation lays out the KV cache, describes a step, and attends."""

    def cache_shapes(self, num_blocks: int, block_size: int, kv_heads: int,
                     head_dim: int) -> list[tuple[int, ...]]:
        """Shapes of one layer's cache tensors: keys and values, apart."""
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return [shape, shape]

    @abstractmethod
    def metadata(self, layout: StepLayout, to_device: ToDevice) -> AttentionMetadata:
        """The per-step tensors every layer reads, copied to the device."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write the new ``key``/``value`` into the cache, then attend ``query`` ``[T, H, D]``."""


@dataclass(frozen=True, slots=True)
class RaggedMetadata(AttentionMetadata):
    decode_token_index: torch.Tensor  # [num_decodes] token index of each one-token row
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] keys each row sees
    all_decode: bool  # every token is a decode row, in order: no scatter needed
    # Prefill rows, one segment each: (token start, query len, context len), and their tables.
    prefills: tuple[tuple[int, int, int], ...]
    prefill_block_tables: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class TorchAttention(AttentionBackend):
    block_size: int
    sliding_window: int | None

    def metadata(self, layout: StepLayout, to_device: ToDevice) -> RaggedMetadata:
        starts, lens = layout.query_start_loc[:-1], np.diff(layout.query_start_loc)
        seq_lens, bs = layout.seq_lens, self.block_size
        decodes, prefills = np.flatnonzero(lens == 1), np.flatnonzero(lens > 1)
        max_blocks = int(-(-seq_lens[decodes].max() // bs)) if len(decodes) else 0
        table = layout.block_table.astype(np.int64)
        # One mask per step, shared by every layer: row r sees keys at positions < seq_len.
        k_pos = np.arange(max_blocks * bs)[None, :]
        visible = k_pos < seq_lens[decodes][:, None]
        if self.sliding_window is not None:
            visible &= k_pos >= seq_lens[decodes][:, None] - self.sliding_window
        return RaggedMetadata(
            slot_mapping=to_device(layout.slot_mapping, True),
            decode_token_index=to_device(starts[decodes], False),
            decode_block_tables=to_device(table[decodes, :max_blocks], False),
            decode_mask=to_device(visible[:, None, None, :], False),
            all_decode=len(decodes) == len(layout.slot_mapping),
            prefills=tuple((int(starts[r]), int(lens[r]), int(seq_lens[r])) for r in prefills),
            prefill_block_tables=tuple(to_device(table[r, :-(-seq_lens[r] // bs)], False)
                                       for r in prefills),
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, meta: RaggedMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        group = query.shape[1] // k_cache.shape[2]
        if meta.all_decode:  # the common decode step: one fused attention call, no scatter
            return self._decode(query, k_cache, v_cache, meta, scale, group)
        out = torch.zeros_like(query)  # rows of padding tokens stay zero
        if meta.decode_token_index.numel():
            decoded = self._decode(query[meta.decode_token_index], k_cache, v_cache, meta, scale,
                                   group)
            out.index_copy_(0, meta.decode_token_index, decoded)
        for (start, q_len, ctx_len), table in zip(meta.prefills, meta.prefill_block_tables):
            q = query[start:start + q_len].transpose(0, 1)  # [H, Lq, D]
            keys = k_cache[table].flatten(0, 1)[:ctx_len].transpose(0, 1)  # [Hkv, Lc, D]
            values = v_cache[table].flatten(0, 1)[:ctx_len].transpose(0, 1)
            # Query i sits at position ctx_len - q_len + i.
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
            k_pos = torch.arange(ctx_len, device=query.device)[None, :]
            attended = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed_keys(q_pos, k_pos, self.sliding_window),
                scale=scale, enable_gqa=group > 1)
            out[start:start + q_len] = attended.transpose(0, 1)
        return out

    @staticmethod
    def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: RaggedMetadata, scale: float, group: int) -> torch.Tensor:
        keys = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)  # [R, Hkv, L, D]
        values = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            query.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale,
            enable_gqa=group > 1)  # [R, H, 1, D]
        return attended.squeeze(2)


@dataclass(frozen=True, slots=True)
class PaddedMetadata(AttentionMetadata):
    positions: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [T, max_blocks] the block-table row of each token's request


@dataclass(frozen=True)
class PaddedAttention(AttentionBackend):
    sliding_window: int | None

    def metadata(self, layout: StepLayout, to_device: ToDevice) -> PaddedMetadata:
        tables = np.zeros((len(layout.positions), layout.block_table.shape[1]), dtype=np.int64)
        tables[:layout.num_tokens] = layout.block_table[layout.token_rows]  # padding: null block
        return PaddedMetadata(to_device(layout.slot_mapping, True),
                              to_device(layout.positions, True), to_device(tables, True))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, meta: PaddedMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        return attend_paged_rows(query, k_cache, v_cache, meta.block_tables, meta.positions,
                                 scale, self.sliding_window)


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
                kv_cache: KVCache, meta: PallasMetadata, scale: float) -> torch.Tensor:
        from torch_xla.experimental.custom_kernel import ragged_paged_attention

        (cache,) = kv_cache
        tokens, num_heads, head_dim = query.shape
        pad = (0, cache.shape[-1] - head_dim)
        kv = torch.stack((F.pad(key, pad), F.pad(value, pad)), dim=2).flatten(1, 2)  # [T, 2Hkv, Dp]
        cache.view(-1, *cache.shape[2:]).index_copy_(0, meta.slot_mapping, kv)
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
        return out[..., :head_dim]


def select_attention(backend: "Backend", config: ModelConfig, block_size: int,
                     max_num_seqs: int) -> AttentionBackend:
    """The one place that decides how attention runs: Pallas on a TPU only."""
    window = config.sliding_window
    if backend.on_tpu:
        return PallasAttention(window, max_num_seqs, backend.mesh)
    if backend.static_shapes:
        return PaddedAttention(window)
    return TorchAttention(block_size, window)
