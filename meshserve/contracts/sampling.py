"""Sampling parameters and how a sequence ends: what a user asks for, checked where it is made.

Plain data with no torch or Ray, so the offline API, the HTTP edge, the scheduler and the runner
share one definition and one set of limits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshserve.contracts.structured import StructuredOutputParams

# The most top logprobs a request may ask for. The runner gathers this many in its compiled
# sampling graph whatever a request wants, so the limit is a graph dimension, not just a check.
MAX_LOGPROBS = 20


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    GRAMMAR = "grammar"  # the request's structured-output grammar allows no further token


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; the names and defaults follow vLLM's ``SamplingParams``.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. ``seed`` makes
    a request reproducible whatever else shares its batch. ``logprobs=k`` returns the log
    probabilities of the sampled token and the ``k`` most likely tokens of the unmodified model
    distribution (before penalties and a grammar's mask). A sequence's text leaves out the stop
    string, or the eos or stop token id, that ended it, unless ``include_stop_str_in_output``.
    ``structured_outputs`` constrains the output to a JSON schema, a regex, a choice or a
    grammar (``StructuredOutputParams``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        # Accept the shapes users pass to vLLM (a str or list for stop, lists for ids).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"{name} {message}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            fail("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got "
                                    f"{self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must hold non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputParams):
            fail("structured_outputs", "must be a StructuredOutputParams, got "
                                       f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
