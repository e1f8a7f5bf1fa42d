"""Ragged paged attention over a batch that mixes prefills and decodes.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, kv_heads, head_dim]``.
New keys and values are written through ``slot_mapping`` (one flat slot per token); queries read
each request's context back through its row of the block table, so a request's KV never needs to
be contiguous.

Two implementations sit behind ``select_attention``: the pure torch one here (every backend) and
torch_xla's Pallas ragged paged attention kernel (TPU only, see ``spmd/backend.py``). The choice
is made once, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step tensors every attention layer reads. Built on the CPU by the runner."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token (padding: block 0)
    # Decode rows (one query token each), batched together.
    decode_token_index: torch.Tensor  # [num_decodes] token index of each decode row
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] block ids
    decode_seq_lens: torch.Tensor  # [num_decodes] context length including the new token
    # Prefill rows (several query tokens), one segment each: (token start, query len, context len).
    prefills: tuple[tuple[int, int, int], ...]
    prefill_block_tables: tuple[torch.Tensor, ...]  # per prefill: [num_blocks_of_its_context]
    sliding_window: int | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, kv_heads, head_dim]`` at their slots, in place."""
    blocks, block_size, heads, dim = k_cache.shape
    k_cache.view(blocks * block_size, heads, dim).index_copy_(0, slot_mapping, key)
    v_cache.view(blocks * block_size, heads, dim).index_copy_(0, slot_mapping, value)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # [blocks_of_context, block_size, kv_heads, head_dim] -> [length, kv_heads, head_dim]
    return cache[block_table].flatten(0, 1)[:length]


def torch_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of ``query`` ``[num_tokens, heads, head_dim]`` against the paged cache.

    The new tokens' KV must already be written. Returns ``[num_tokens, heads, head_dim]``; rows of
    padding tokens are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.zeros_like(query)

    if meta.decode_token_index.numel():
        q = query[meta.decode_token_index].view(-1, kv_heads, group, head_dim)  # [R, Hkv, G, D]
        keys = k_cache[meta.decode_block_tables].flatten(1, 2)  # [R, L, Hkv, D]
        values = v_cache[meta.decode_block_tables].flatten(1, 2)
        scores = torch.einsum("rhgd,rlhd->rhgl", q, keys).float() * scale  # [R, Hkv, G, L]
        positions = torch.arange(keys.shape[1], device=query.device)
        seq_lens = meta.decode_seq_lens[:, None]
        masked = positions[None, :] >= seq_lens  # [R, L]
        if meta.sliding_window is not None:
            masked |= positions[None, :] < seq_lens - meta.sliding_window
        scores.masked_fill_(masked[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        decoded = torch.einsum("rhgl,rlhd->rhgd", probs, values).reshape(-1, num_heads, head_dim)
        out.index_copy_(0, meta.decode_token_index, decoded)

    for (start, q_len, ctx_len), table in zip(meta.prefills, meta.prefill_block_tables):
        q = query[start:start + q_len].transpose(0, 1)  # [H, Lq, D]
        keys = _gather_context(k_cache, table, ctx_len).transpose(0, 1)  # [Hkv, Lc, D]
        values = _gather_context(v_cache, table, ctx_len).transpose(0, 1)
        # Query i sits at position ctx_len - q_len + i and sees keys up to and including it.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
        k_pos = torch.arange(ctx_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if meta.sliding_window is not None:
            allowed &= k_pos > q_pos - meta.sliding_window
        attended = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed, scale=scale, enable_gqa=group > 1)
        out[start:start + q_len] = attended.transpose(0, 1)
    return out
