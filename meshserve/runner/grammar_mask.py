"""Structured output on the device: a packed grammar bitmask applied to the rows it constrains.

The host fills one packed row per constrained request (32 tokens per int32, see
``contracts.step.GrammarBitmask``); the runner lays those rows out as the sampler's rows, padded to
the request bucket, and this function unpacks them on the device and keeps only the allowed tokens'
logits. Every shape depends on the row count and the vocabulary alone, never on how many rows are
constrained, so a compiling backend builds one masked program per request bucket; a row whose
``constrained`` flag is off passes through bit for bit, so free requests sample exactly what they
would sample alone.
"""

from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          constrained: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[R, V]`` with every token a constrained row's mask forbids set to -inf.

    ``bitmask`` is ``[R, ceil(V / 32)]`` int32, bit ``b`` of word ``w`` allowing token
    ``32 * w + b``; ``constrained`` is ``[R]`` bool. Unconstrained rows are returned unchanged.
    """
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    # An arithmetic shift of a negative word still leaves bit b in the lowest place.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0  # [R, V]
    keep = allowed | ~constrained.unsqueeze(-1)
    return torch.where(keep, logits, float("-inf"))
