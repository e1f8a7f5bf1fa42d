"""The step contract between the scheduler and the runner, as plain data.

The scheduler never touches a device and the runner never decides who runs; one step in
(``SchedulerOutput``: who runs, how many tokens each, which blocks, and the grammar masks of the
constrained requests) and one step out (``RunnerOutput``: the sampled tokens) are all they share.
The lead host of a multi-host replica sends the same ``SchedulerOutput`` to its followers, so it
must stay picklable and device-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

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


# A packed mask row that allows every token: all 32 bits of every word set.
ALLOW_ALL = -1


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one packed mask row: 32 tokens per word."""
    return -(-vocab_size // 32)


@dataclass(frozen=True, slots=True, eq=False)
class GrammarBitmask:
    """The tokens each constrained request may sample this step, packed 32 to an int32.

    Bit ``b`` of word ``w`` of a row allows token ``32 * w + b``. Only requests whose token this
    step is real (not a chunk of an unfinished prefill) are listed; every other row is free. The
    host that holds the grammars fills it; followers of a multi-host replica apply the same rows.
    """

    request_ids: tuple[str, ...]
    bitmask: np.ndarray  # [len(request_ids), bitmask_words(vocab)] int32

    def rows(self, row_request_ids: Sequence[str | None], num_rows: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """The masks laid out for the sampler's rows: row ``i`` belongs to
        ``row_request_ids[i]`` (None or past the end: padding).

        Returns ``bitmask`` ``[num_rows, words]`` int32 (free rows allow everything) and
        ``constrained`` ``[num_rows]`` bool.
        """
        bitmask = np.full((num_rows, self.bitmask.shape[1]), ALLOW_ALL, dtype=np.int32)
        constrained = np.zeros(num_rows, dtype=bool)
        where = {request_id: i for i, request_id in enumerate(self.request_ids)}
        for row, request_id in enumerate(row_request_ids[:num_rows]):
            source = where.get(request_id) if request_id is not None else None
            if source is not None:
                bitmask[row] = self.bitmask[source]
                constrained[row] = True
        return bitmask, constrained


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step, as plain data: what the lead host broadcasts to its followers."""

    new_requests: tuple[NewRequestData, ...]
    running_requests: tuple[RunningRequestData, ...]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: frozenset[str]  # finished, aborted or preempted since the last step
    grammar: GrammarBitmask | None = None  # None: no constrained request samples this step

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
    # Requests with prompt_logprobs whose prompt tokens were computed this step: the logprobs
    # of each next prompt token, in position order (a chunked prefill reports one run per step).
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
