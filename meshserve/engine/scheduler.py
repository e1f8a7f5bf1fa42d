"""Continuous batching: decides who runs each step and emits it as plain data.

There is no separate prefill phase. Every request carries ``num_computed_tokens``; each step gives
running requests, then waiting ones, as many of their uncomputed tokens as the token budget allows
(so long prompts are prefilled in chunks beside ongoing decodes). When KV blocks run out, the most
recently admitted running request is preempted: its blocks are freed and it is recomputed later.
The scheduler never touches a device; the runner never decides who runs. The step between them
is plain data (``meshserve.contracts.step``).
"""

from __future__ import annotations

import time
from collections import deque

from meshserve.config import SchedulerConfig
from meshserve.contracts.sampling import FinishReason
from meshserve.contracts.step import (NewRequestData, RunnerOutput, RunningRequestData,
                                      SchedulerOutput)
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting and running queues and the block manager. ``config`` comes resolved:
    its token budget and max_model_len are numbers (``EngineCore`` fills the device defaults)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.max_num_batched_tokens is None or config.max_model_len is None:
            raise ValueError("Scheduler needs max_num_batched_tokens and max_model_len set")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._sample_index: dict[str, int] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue changes
    def add_request(self, request: Request, sample_index: int = 0) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival = request.arrival or time.monotonic()
        self.requests[request.request_id] = request
        self._sample_index[request.request_id] = sample_index
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish_reason = FinishReason.ABORT
        self._finish(request)
        return request

    def _finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.block_manager.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        del self._sample_index[request.request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        running_data: list[RunningRequestData] = []
        new_data: list[NewRequestData] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self.block_manager.allocate(request, num_new)
            while new_blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = self.block_manager.allocate(request, num_new)
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            running_data.append(RunningRequestData(
                request.request_id, tuple(new_blocks), request.num_computed_tokens))
            index += 1

        # Admitting new work right after a preemption would only thrash the cache.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            # The first that may run: a request whose grammar still compiles lets others pass.
            request = next((r for r in self.waiting if r.schedulable), None)
            if request is None:
                break
            # Prompt logprobs need the logits of every prompt token: nothing from the cache.
            cached = ([] if request.params.prompt_logprobs is not None
                      else self.block_manager.find_cached_prefix(request))
            request.num_computed_tokens = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            blocks = self.block_manager.allocate(request, num_new, cached)
            if blocks is None:
                request.num_computed_tokens = 0
                break
            self.waiting.remove(request)
            stats = self.block_manager.stats
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += request.num_computed_tokens
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_data.append(NewRequestData(
                request_id=request.request_id,
                token_ids=tuple(request.all_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                params=request.params,
                sample_index=self._sample_index[request.request_id],
                block_ids=tuple(self.block_manager.block_ids(request.request_id)),
                num_computed_tokens=request.num_computed_tokens,
            ))

        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return SchedulerOutput(tuple(new_data), tuple(running_data), num_scheduled, finished)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.prompt_logprobs:  # recomputed from the start: gathered again
            request.prompt_logprobs = []
        self.waiting.appendleft(request)
        self._finished_ids.add(request.request_id)  # the runner drops it until it is resumed
        self.num_preemptions += 1

    def update(self, step: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Apply a step's results; return the requests that got a token or finished."""
        max_len = self.config.max_model_len
        changed: list[Request] = []
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_tokens
            self.block_manager.cache_full_blocks(request)
            token = output.sampled_token_ids.get(request_id)
            if token is None:
                continue  # a prefill chunk that is not the last one
            done = request.append_token(token, max_len)
            changed.append(request)
            if done:
                self._finish(request)
        return changed
