"""A request as the scheduler tracks it: its tokens so far, its status, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshserve.contracts.sampling import FinishReason, SamplingParams

if TYPE_CHECKING:
    from meshserve.structured.state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated. ``n > 1`` is expanded into ``n`` requests by the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, last admission
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    grammar: GrammarState | None = None  # structured output: the matcher, on the host only
    # prompt_logprobs gathered over the prefill's steps until the first token carries them out
    # (None once delivered: a preempted request's recomputed prompt reports nothing again).
    prompt_logprobs: list | None = field(default_factory=list)

    @property
    def schedulable(self) -> bool:
        """Whether the scheduler may admit it: a constrained request waits for its grammar."""
        return self.grammar is None or self.grammar.ready

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> bool:
        """Record a sampled token; return True when it ends the request."""
        self.output_token_ids.append(token_id)
        params = self.params
        if self.grammar is not None and self.grammar.finish_reason is not None:
            # The grammar ended it: a stop token completed it, or it allows nothing further.
            self.finish_reason = self.grammar.finish_reason
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason, self.stop_token_id = FinishReason.STOP, token_id
        elif token_id in params.stop_token_ids:
            self.finish_reason, self.stop_token_id = FinishReason.STOP, token_id
        elif len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
