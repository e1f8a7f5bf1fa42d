"""Static shape buckets: the finite set of (tokens, requests, context) shapes the runner executes.

A compiling backend compiles each bucket once at warm-up; every step is padded up to the first
bucket that fits, so serving never meets a new shape.
"""

from __future__ import annotations

import bisect


def token_buckets(max_tokens: int, gap: int = 0, start: int = 16) -> list[int]:
    """Double from ``start``; with a ``gap``, double up to it and then grow by it. Covers max."""
    buckets = [start]
    while buckets[-1] < max_tokens:
        last = buckets[-1]
        buckets.append(last * 2 if gap == 0 or last < gap else last + gap)
    return buckets


def request_buckets(max_requests: int, start: int = 8) -> list[int]:
    """Powers of two from ``start``, the last one capped at ``max_requests``."""
    buckets = [min(start, max_requests)]
    while buckets[-1] < max_requests:
        buckets.append(min(buckets[-1] * 2, max_requests))
    return buckets


def context_buckets(max_blocks: int, start: int = 4, factor: int = 4) -> list[int]:
    """Block-table widths: ``start`` blocks, times ``factor`` each, the last capped at
    ``max_blocks``. Coarse on purpose: each width multiplies the forward programs."""
    buckets = [min(start, max_blocks)]
    while buckets[-1] < max_blocks:
        buckets.append(min(buckets[-1] * factor, max_blocks))
    return buckets


def reachable_request_buckets(requests: list[int], tokens: int) -> list[int]:
    """The request buckets a step of at most ``tokens`` tokens can fill: each request brings at
    least one token, so a bucket whose predecessor already holds ``tokens`` requests is out."""
    previous = [0] + requests[:-1]
    return [bucket for low, bucket in zip(previous, requests) if low < tokens]


def pick_bucket(buckets: list[int], count: int) -> int:
    """The first bucket >= count."""
    index = bisect.bisect_left(buckets, count)
    if index == len(buckets):
        raise ValueError(f"{count} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]
