"""What every attention implementation shares: the step's layout, its metadata, the interface.

The KV cache of one layer is a tuple of tensors whose layout the implementation chooses; new keys
and values are written through a slot mapping (one flat cache slot per token), and queries read
each request's context back through its row of the block table, so a request's KV never needs to
be contiguous.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    block_table: np.ndarray  # [n, context_blocks] int32, cut to a context bucket

    @property
    def num_tokens(self) -> int:
        return len(self.token_rows)

    @property
    def context_blocks(self) -> int:
        """The block table's width: a graph dimension of the forward on a static-shape backend."""
        return self.block_table.shape[1]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """The per-step tensors every layer's attention reads, on the device, built once per step by
    ``AttentionBackend.metadata``. Each implementation extends it with what its kernel needs."""

    slot_mapping: torch.Tensor  # [T] flat cache slot each token's new key/value is written to


class AttentionBackend(ABC):
    """How one implementation lays out the KV cache, describes a step, and attends."""

    # Whether ``forward`` writes the cache it was given (True) or returns an updated copy that
    # the layer must hold from the next step on (False: XLA, where buffers are donated).
    writes_in_place = False

    def cache_shapes(self, num_blocks: int, block_size: int, kv_heads: int,
                     head_dim: int) -> list[tuple[int, ...]]:
        """Shapes of one layer's cache tensors: keys and values, apart."""
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return [shape, shape]

    def context_buckets(self, max_blocks: int) -> list[int]:
        """The block-table widths a step may be laid out at (the forward is compiled per width
        on a static-shape backend). The whole row by default: the kernel reads as far as each
        request's length says, whatever the width."""
        return [max_blocks]

    def bind_cache(self, cache: KVCache) -> Any:
        """What a layer holds to reach its cache; its ``forward`` gets it back as ``kv_cache``.

        The cache itself by default: on xla it is then an input of the compiled forward, updated
        in place by XLA's aliasing. The cpu implementation returns an id instead (see there)."""
        return cache

    @abstractmethod
    def metadata(self, layout: StepLayout, to_device: ToDevice) -> AttentionMetadata:
        """The per-step tensors every layer reads, copied to the device."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: Any, meta: AttentionMetadata,
                scale: float) -> tuple[torch.Tensor, Any]:
        """Write the new ``key``/``value`` into the cache (``kv_cache`` is what ``bind_cache``
        returned), then attend ``query`` ``[T, H, D]``; returns the output and the cache as the
        layer holds it from now on (the same one where the write is in place)."""


