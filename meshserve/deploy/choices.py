"""Fan a request out into sequences on the engines, and turn their token streams into text.

One OpenAI request with several prompts and ``n`` samples becomes ``prompts × n`` sequences
(choice ``i * n + j``), each placed on an engine replica by ``EngineClient``; this module runs them
concurrently and yields ``ChoiceEvent`` s in arrival order. Each choice is a
``meshserve.text.SequenceText``: text and stop strings are applied here, at the edge; the engines
only see token ids.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from meshserve.actors.messages import GenerateSpec
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.tokens import TokenDelta, TokenLogprobs
from meshserve.deploy.client import EngineClient
from meshserve.text.detokenizer import Tokenizer
from meshserve.text.sequence import SequenceText


@dataclass(kw_only=True)
class ChoiceState(SequenceText):
    """One choice: its sequence's text and tokens, and where it stands in the request."""

    index: int
    prompt_token_ids: list[int]
    first_token_at: float | None = None
    # With prompt_logprobs: prompt tokens 1.. (token i given the tokens before it), from the
    # first delta.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """New text (and the tokens behind it) of one choice; ``finish_reason`` set on its last."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: int | str | None  # SequenceText.stop_reason, on the last event


class ChoiceRunner:
    """Runs the sequences of one request on the engines and tracks their state."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, prompts: list[list[int]],
                 params: SamplingParams) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.params = params
        self.request_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.choices = [ChoiceState.start(tokenizer, prompt, params, index=i * params.n + j,
                                          prompt_token_ids=prompt)
                        for i, prompt in enumerate(prompts) for j in range(params.n)]
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None

    async def start(self) -> None:
        """Submit every sequence; return once each has produced its first tokens.

        A request the engines refuse (overload, invalid prompt) raises here, before any
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
        stream = self.client.stream(spec)
        first = True
        try:
            async for batch in stream:
                if first:
                    first = False
                    self._first_response()
                for delta in batch:
                    event = self._apply(choice, delta)
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
            # A sequence ended here (stop string, error, disconnect) is aborted on its replica.
            await stream.aclose()
            queue.put_nowait(None)

    @staticmethod
    def _apply(choice: ChoiceState, delta: TokenDelta) -> ChoiceEvent:
        if choice.first_token_at is None:
            choice.first_token_at = time.monotonic()
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        text = choice.apply(delta)
        return ChoiceEvent(choice.index, text, delta.token_ids, delta.logprobs or (),
                           choice.finish_reason, choice.stop_reason)

    # ------------------------------------------------------------------ summaries
    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_token_ids) for c in self.choices[::self.params.n])

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
