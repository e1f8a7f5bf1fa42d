"""What an engine reports: new tokens per request (with their logprobs) and its own counters.

Plain data that crosses processes (host actor → router → ingress) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

# One generated token's logprobs: (logprob of the sampled token, the top token ids, their
# logprobs), the top ones most likely first and cut to the request's ``SamplingParams.logprobs``.
TokenLogprobs = tuple[float, tuple[int, ...], tuple[float, ...]]


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request after a step; plain data, safe to send between processes."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: str | None  # a FinishReason value on the request's last delta
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs, on the request's first delta: prompt token i's
    # logprobs given the tokens before it, for i = 1 .. len(prompt) - 1 (the first has none).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int  # model steps this host ran
    execute_seconds: float  # wall seconds those steps took, sampling included
    cpu_wait_seconds: float  # of those, the stepping thread's wait for a busy core
