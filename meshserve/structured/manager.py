"""The engine's side of structured output: a grammar state per constrained request, the masks of
each step, and the sampled tokens fed back.

After vLLM's ``StructuredOutputManager``: a request's grammar compiles on a worker thread while
the request waits (the scheduler admits it once its state is ready, and admits others meanwhile);
each step, the masks of the constrained requests that sample are gathered into the step itself
(``SchedulerOutput.grammar``), so the runner, and every follower host of a multi-host replica,
applies the same rows; after the step, each constrained request's matcher takes its sampled token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.step import GrammarBitmask, RunnerOutput, SchedulerOutput, bitmask_words
from meshserve.structured.compiler import GrammarCompiler
from meshserve.structured.state import GrammarState

if TYPE_CHECKING:
    from meshserve.engine.request import Request

# The longest an idle engine blocks on a compiling grammar before it looks at its queues again.
WAIT_TIMEOUT_S = 0.05


class StructuredOutputManager:
    """Grammar states and masks for one engine's requests."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: GrammarCompiler | None = None  # built on the first constrained request
        self._closing_mask = packed_mask(self.stop_token_ids, vocab_size)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    def start(self, params: SamplingParams) -> GrammarState | None:
        """A new grammar state for a request (None when it is unconstrained). Its grammar starts
        compiling now; an invalid constraint raises ``StructuredOutputError`` and queues nothing."""
        if params.structured_outputs is None:
            return None
        return GrammarState(self.compiler.submit(params.structured_outputs), self._closing_mask)

    def wait_for_grammars(self, waiting: Iterable[Request],
                          timeout: float = WAIT_TIMEOUT_S) -> None:
        """Block until one of the ``waiting`` requests' grammars is compiled, or ``timeout``."""
        pending = [r.grammar.compiled for r in waiting
                   if r.grammar is not None and not r.grammar.ready]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def attach_bitmask(self, step: SchedulerOutput,
                       requests: Mapping[str, Request]) -> SchedulerOutput:
        """``step`` with the masks of the constrained requests whose token it samples for real."""
        ids, rows = [], []
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None or request.grammar is None:
                continue
            if request.num_computed_tokens + num_tokens < request.num_tokens:
                continue  # a prefill chunk: its sample is thrown away, so it needs no mask
            ids.append(request_id)
            rows.append(request.grammar.next_mask)
        if not ids:
            return step
        return replace(step, grammar=GrammarBitmask(tuple(ids), np.stack(rows)))

    def accept(self, output: RunnerOutput, requests: Mapping[str, Request]) -> None:
        """Advance each constrained request's grammar past the token it sampled."""
        for request_id, token in output.sampled_token_ids.items():
            request = requests.get(request_id)
            if request is not None and request.grammar is not None:
                request.grammar.accept(token)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def packed_mask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A packed mask row ``[bitmask_words(vocab_size)]`` int32 allowing exactly ``token_ids``."""
    words = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
    for token in token_ids:
        words[token // 32] |= np.uint32(1 << (token % 32))
    return words.view(np.int32)
