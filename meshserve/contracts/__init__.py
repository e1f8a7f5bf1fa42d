"""The plain-data contracts between the parts: no torch, no Ray, nothing but dataclasses.

- ``sampling``: what a request asks for (``SamplingParams``, ``MAX_LOGPROBS``, ``FinishReason``);
- ``step``: scheduler → runner and back (``SchedulerOutput``, ``RunnerOutput``);
- ``tokens``: engine → host actor → router → edge (``TokenDelta``, ``TokenLogprobs``,
  ``EngineStats``);
- ``prompt``: the checks of a prompt against a model's limits (``PromptLimits``, ``PromptError``).

The runner, the host actors and the router import these, never the scheduler or the engine loop.
"""

from meshserve.contracts.prompt import PromptError, PromptLimits
from meshserve.contracts.sampling import MAX_LOGPROBS, FinishReason, SamplingParams
from meshserve.contracts.step import (NewRequestData, RunnerOutput, RunningRequestData,
                                      SchedulerOutput)
from meshserve.contracts.tokens import EngineStats, TokenDelta, TokenLogprobs

__all__ = ["MAX_LOGPROBS", "EngineStats", "FinishReason", "NewRequestData", "PromptError",
           "PromptLimits", "RunnerOutput", "RunningRequestData", "SamplingParams",
           "SchedulerOutput", "TokenDelta", "TokenLogprobs"]
