"""Structured output on the device: a packed grammar bitmask applied to the rows it constrains.

The host fills one packed row per constrained request (32 tokens per int32, see
``contracts.step.GrammarBitmask``); the runner lays those rows out as the sampler's rows, padded to
the request bucket, and this function unpacks them on the device and keeps only the allowed tokens'
logits. Every shape depends on the row count and the vocabulary alone, never on how many rows are
constrained, so a compiling backend builds one masked program per request bucket; a row whose
``constrained`` flag is off passes through bit for bit, so free requests sample exactly what they
would sample alone. An eager backend may instead pass only the constrained rows (and no flags):
the work then scales with them, not with the batch.
"""

from __future__ import annotations

import torch

# Bit b of an int32 word, as an int32 (bit 31 is the sign bit: -2**31).
_BITS = [1 << b if b < 31 else -(1 << 31) for b in range(32)]


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          constrained: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` ``[R, V]`` with every token a constrained row's mask forbids set to -inf.

    ``bitmask`` is ``[R, ceil(V / 32)]`` int32, bit ``b`` of word ``w`` allowing token
    ``32 * w + b``; ``constrained`` is ``[R]`` bool (None: every row). Unconstrained rows are
    returned unchanged.
    """
    rows, vocab = logits.shape
    bits = torch.tensor(_BITS, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bitmask.unsqueeze(-1) & bits) != 0).reshape(rows, -1)[:, :vocab]  # [R, V]
    if constrained is not None:
        allowed = allowed | ~constrained.unsqueeze(-1)
    return torch.where(allowed, logits, float("-inf"))
