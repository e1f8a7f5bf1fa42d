"""The step contract between the scheduler and the runner, as plain data.

The scheduler never touches a device and the runner never decides who runs; one step in
(``SchedulerOutput``: who runs, how many tokens each, which blocks) and one step out
(``RunnerOutput``: the sampled tokens) are all they share. The lead host of a multi-host replica
sends the same ``SchedulerOutput`` to its followers, so it must stay picklable and device-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.tokens import TokenLogprobs


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen (or has dropped after a preemption)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt and any tokens generated before a preemption
    num_prompt_tokens: int
    params: SamplingParams
    sample_index: int  # which of a prompt's n samples: keys its seeded random stream
    block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class RunningRequestData:
    """A request the runner already holds: only what changed."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step, as plain data: what the lead host broadcasts to its followers."""

    new_requests: tuple[NewRequestData, ...]
    running_requests: tuple[RunningRequestData, ...]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: frozenset[str]  # finished, aborted or preempted since the last step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What one step produced: a token for every request whose known tokens were all computed."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # requests that asked
