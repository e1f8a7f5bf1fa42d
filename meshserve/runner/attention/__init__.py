"""Paged attention over a flat batch of tokens that mixes prefills and decodes.

Three implementations; ``select_attention`` is the one place that picks:

- ``PagedCpuAttention`` (the cpu backend): meshserve's C++ kernel, in place on the paged cache.
- ``PaddedAttention`` (XLA without Pallas, e.g. the PJRT CPU client): static shapes, compilable.
- ``PallasAttention`` (TPU): torch_xla's ragged paged attention kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshserve.config import ModelConfig
from meshserve.runner.attention.base import (AttentionBackend, AttentionMetadata, KVCache,
                                             StepLayout, ToDevice)
from meshserve.runner.attention.padded import PaddedAttention, PaddedMetadata
from meshserve.runner.attention.paged_cpu import PagedCpuAttention, PagedCpuMetadata
from meshserve.runner.attention.pallas import PallasAttention, PallasMetadata

if TYPE_CHECKING:
    from meshserve.spmd.backend import Backend

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "PaddedAttention",
           "PaddedMetadata", "PagedCpuAttention", "PagedCpuMetadata", "PallasAttention",
           "PallasMetadata", "StepLayout", "ToDevice", "select_attention"]


def select_attention(backend: "Backend", config: ModelConfig,
                     max_num_seqs: int) -> AttentionBackend:
    """The one place that decides how attention runs: Pallas on a TPU only."""
    window = config.sliding_window
    if backend.on_tpu:
        return PallasAttention(window, max_num_seqs, backend.mesh)
    if backend.static_shapes:
        return PaddedAttention(window)
    return PagedCpuAttention(window)
