"""What routers, Ray programs and host actors send each other: plain, picklable dataclasses, and
the errors they raise to each other.

Importing this module loads neither torch nor the engine, so the router and the HTTP edge can
name these types without the stack behind a host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshserve.contracts.prompt import PromptLimits
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.tokens import TokenDelta, TokenLogprobs


def direct_channel(request_id: str) -> str:
    """The private channel of a sequence streamed by one call (``stream_spec``) rather than
    submitted to a caller's shared channel; hosts report load per channel under this name."""
    return f"direct-{request_id}"


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """One sequence to generate, as sent from a router to a host."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    sample_index: int = 0


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished sequence: what the unary ``generate`` calls return."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @classmethod
    def from_deltas(cls, request_id: str, deltas: Sequence[TokenDelta]) -> "Completion":
        last = deltas[-1]
        logprobs = None
        if last.logprobs is not None:
            logprobs = tuple(lp for d in deltas for lp in d.logprobs or ())
        return cls(request_id, tuple(t for d in deltas for t in d.token_ids), last.finish_reason,
                   last.num_prompt_tokens, last.num_cached_tokens, logprobs)


@dataclass(frozen=True, slots=True)
class HostInfo:
    node_id: str
    host_index: int
    model_name: str
    max_model_len: int
    vocab_size: int
    num_total_blocks: int
    block_size: int
    tpu_env: dict[str, str] = field(default_factory=dict)  # the TPU runtime variables it runs with
    pid: int = 0  # the actor's process, for operators (and fault-injection tests)
    engine_cpus: tuple[int, ...] = ()  # the CPUs its engine computes on (see reserved_cpus)

    @property
    def prompt_limits(self) -> PromptLimits:
        """What the host's engine accepts: the edge checks requests with it before routing."""
        return PromptLimits(self.max_model_len, self.vocab_size)


class HostError(RuntimeError):
    """The engine of a host failed (or its replica fell out of step); its requests are lost."""


@dataclass(frozen=True, slots=True)
class SequenceError:
    """Sent on an output channel in place of a sequence's next deltas: it ended with ``error``
    (the other sequences of the channel carry on)."""

    request_id: str
    error: BaseException


class RouterOverloaded(RuntimeError):
    """The engine replica chosen for a sequence already holds ``max_queued_requests`` sequences;
    the client should retry later."""


class ChannelClosed(RuntimeError):
    """A host closed an output channel whose subscriber went silent; its requests were aborted."""


class ServerDraining(RuntimeError):
    """The server is shutting down: it takes no new sequences, and ends those still running."""


class RequestRejected(ValueError):
    """A host refused a request as invalid (the message says why)."""
