"""Fan a request out into sequences on the router, and turn their token streams into text.

One OpenAI request with several prompts and ``n`` samples becomes ``prompts × n`` sequences
(choice ``i * n + j``), each its own router stream; this module runs them concurrently and yields
``ChoiceEvent`` s in arrival order. Text, stop strings and logprob formatting live here, at the
edge: the router and hosts only see token ids.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from meshserve.actors.messages import GenerateSpec
from meshserve.engine.detokenizer import IncrementalDetokenizer
from meshserve.contracts.sampling import SamplingParams


@dataclass
class ChoiceState:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # per token: (sampled logprob, [(token id, logprob), ...] top entries)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    first_token_at: float | None = None


@dataclass(frozen=True)
class ChoiceEvent:
    """New text (and the tokens behind it) of one choice; ``finish_reason`` set on its last."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    finish_reason: str | None


class ChoiceRunner:
    """Runs the sequences of one request against the router and tracks their state."""

    def __init__(self, router, tokenizer, prompts: list[list[int]], params: SamplingParams) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.params = params
        self.request_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.choices = [ChoiceState(i * params.n + j, prompt)
                        for i, prompt in enumerate(prompts) for j in range(params.n)]
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None

    async def start(self) -> None:
        """Submit every sequence; return once each has produced its first tokens.

        A request the router refuses (overload, invalid prompt) raises here, before any
        response has been sent, so the client gets a proper HTTP status even when streaming.
        """
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending_first = len(self.choices)
        self._all_started = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run_choice(c)) for c in self.choices]
        try:
            await self._all_started.wait()
        except asyncio.CancelledError:  # the client left before the first token
            await self.close()
            raise
        if self._failure is not None:
            await self.close()
            raise self._failure

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's events, interleaved as they arrive; errors propagate."""
        remaining = len(self._tasks)
        try:
            while remaining:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    remaining -= 1
                    continue
                yield item
        finally:
            await self.close()

    def interrupt(self, reason: BaseException) -> None:
        """End the request early: its consumer sees ``reason`` raised (e.g. a shutdown)."""
        self._queue.put_nowait(reason)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _first_response(self, failure: BaseException | None = None) -> None:
        if failure is not None and self._failure is None:
            self._failure = failure
        self._pending_first -= 1
        if self._pending_first == 0 or failure is not None:
            self._all_started.set()

    async def _run_choice(self, choice: ChoiceState) -> None:
        queue = self._queue
        spec = GenerateSpec(f"{self.request_id}-{choice.index}", tuple(choice.prompt_token_ids),
                            self.params, sample_index=choice.index % self.params.n)
        detok = IncrementalDetokenizer(self.tokenizer, choice.prompt_token_ids, self.params)
        stream = self.router.options(stream=True).generate_stream.remote(spec)
        first = True
        try:
            async for batch in stream:
                if first:
                    first = False
                    self._first_response()
                for delta in batch:
                    event = self._apply(choice, detok, delta)
                    queue.put_nowait(event)
                    if event.finish_reason is not None:
                        return
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            if first:
                first = False
                self._first_response(exc)
            queue.put_nowait(exc)
        finally:
            if first:  # cancelled before any answer
                self._first_response()
            if choice.finish_reason is None or detok.stopped:
                stream.cancel()  # stop string, error or disconnect: the router aborts the host
            queue.put_nowait(None)

    def _apply(self, choice: ChoiceState, detok: IncrementalDetokenizer, delta) -> ChoiceEvent:
        if choice.first_token_at is None:
            choice.first_token_at = time.monotonic()
        tokens = list(delta.token_ids)
        choice.token_ids.extend(tokens)
        choice.num_cached_tokens = delta.num_cached_tokens
        logprobs = []
        if delta.logprobs is not None:
            for sampled, top_ids, top_lps in delta.logprobs:
                logprobs.append((sampled, list(zip(top_ids, top_lps))))
        choice.logprobs.extend(logprobs)
        text = detok.add(tokens, delta.finish_reason is not None)
        choice.text += text
        reason = delta.finish_reason
        if detok.stopped:
            reason = "stop"
        elif reason == "abort":
            reason = "abort"
        choice.finish_reason = reason
        return ChoiceEvent(choice.index, text, tokens, logprobs, reason)

    # ------------------------------------------------------------------ summaries
    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_token_ids) for c in self.choices[::self.params.n])

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
