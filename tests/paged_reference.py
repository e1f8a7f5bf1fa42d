"""Paged attention in plain torch, one sequence at a time: the reference every implementation is
checked against (the C++ kernel, the padded XLA path, the Pallas layout), and the random mixed
steps they are checked on.

Caches here are in the logical layout ``[num_blocks, block_size, kv_heads, head_dim]``; each test
converts them to the layout of the implementation it checks. The reference writes the step's new
keys and values at their slots, gathers each sequence's context through its block-table row into
a dense tensor, and attends with an explicit causal (and sliding-window) mask, in float64.
"""

from __future__ import annotations

import numpy as np
import torch

from meshserve.runner.attention import StepLayout


def reference_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout,
                              scale: float, window: int | None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (output ``[T, H, D]`` with padding rows zero, keys after the write, values after)."""
    blocks, block_size, kv_heads, dim = k_cache.shape
    keys = k_cache.clone().view(blocks * block_size, kv_heads, dim)
    values = v_cache.clone().view(blocks * block_size, kv_heads, dim)
    real = layout.num_tokens
    slots = torch.from_numpy(layout.slot_mapping[:real])
    keys[slots] = key[:real]
    values[slots] = value[:real]
    heads = query.shape[1]
    group = heads // kv_heads
    out = torch.zeros_like(query)
    starts = layout.query_start_loc
    for s, context in enumerate(layout.seq_lens):
        first, last = int(starts[s]), int(starts[s + 1])
        q_len, context = last - first, int(context)
        if q_len == 0:
            continue
        positions = np.arange(context)
        ctx_slots = layout.block_table[s][positions // block_size].astype(np.int64) * \
            block_size + positions % block_size
        k = keys[torch.from_numpy(ctx_slots)].double()  # [L, Hkv, D]
        v = values[torch.from_numpy(ctx_slots)].double()
        q = query[first:last].double().view(q_len, kv_heads, group, dim)
        scores = torch.einsum("qhgd,lhd->qhgl", q, k) * scale
        q_pos = torch.arange(context - q_len, context)[:, None]
        k_pos = torch.arange(context)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        attended = torch.einsum("qhgl,lhd->qhgd", scores.softmax(-1), v)
        out[first:last] = attended.reshape(q_len, heads, dim).to(query.dtype)
    shape = (blocks, block_size, kv_heads, dim)
    return out, keys.view(shape), values.view(shape)


def mixed_step(q_lens: list[int], seq_lens: list[int], *, block: int, blocks: int, heads: int,
               kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """A step over a randomly filled paged cache; sequence s computes its last q_lens[s] tokens."""
    rng = np.random.default_rng(seed)
    q_lens_a, seq_lens_a = np.array(q_lens), np.array(seq_lens)
    max_blocks = max(-(-n // block) for n in seq_lens) + 1
    tables = np.zeros((len(q_lens), max_blocks), dtype=np.int32)
    free = iter(rng.permutation(np.arange(1, blocks)))  # block 0 is the null block
    for row, length in enumerate(seq_lens):
        tables[row, :-(-length // block)] = [next(free) for _ in range(-(-length // block))]
    starts = np.concatenate([[0], np.cumsum(q_lens_a)]).astype(np.int64)
    rows = np.repeat(np.arange(len(q_lens)), q_lens_a)
    total = int(q_lens_a.sum())
    padded = total + 3  # padding tokens write into the null block and belong to no sequence
    positions = np.zeros(padded, dtype=np.int64)
    positions[:total] = seq_lens_a[rows] - q_lens_a[rows] + np.arange(total) - starts[rows]
    pos = positions[:total]
    slots = np.zeros(padded, dtype=np.int64)
    slots[:total] = tables[rows, pos // block].astype(np.int64) * block + pos % block
    layout = StepLayout(np.zeros(padded, dtype=np.int64), positions, slots, rows, starts,
                        seq_lens_a.astype(np.int64), tables)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(padded, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(padded, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    history = torch.randn(2, blocks, block, kv_heads, dim, generator=gen).to(dtype)
    return layout, q, k, v, history[0], history[1]
