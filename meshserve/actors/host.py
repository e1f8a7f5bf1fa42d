"""``HostActor``: the Ray actor that owns one host's engine.

The engine runs in its own thread, stepping while there is work and sleeping on its inbox when
there is none, so the actor's asyncio loop stays free to take requests, aborts and stats calls.
Results leave through per-subscriber output channels: one Ray streaming call per router, each
item a batch of token deltas from one or more steps, instead of one message per token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from meshserve.config import EngineConfig
from meshserve.engine.engine import EngineCore, EngineStats, TokenDelta
from meshserve.engine.request import SamplingParams

logger = logging.getLogger("meshserve.host")


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """One sequence to generate, as sent from a router to a host."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    sample_index: int = 0


@dataclass(frozen=True, slots=True)
class HostInfo:
    node_id: str
    host_index: int
    model_name: str
    max_model_len: int
    vocab_size: int
    num_total_blocks: int
    block_size: int


class HostError(RuntimeError):
    """The engine of a host failed; every request on it is lost."""


class HostActor:
    """Owns an engine on one host. Create it with ``ray.remote(HostActor)``."""

    def __init__(self, config: EngineConfig, host_index: int = 0,
                 num_threads: int | None = None) -> None:
        import ray
        import torch

        # Ray sets OMP_NUM_THREADS to the actor's CPU count; the engine wants every core it owns.
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        self.engine = EngineCore(config)
        self.host_index = host_index
        self.node_id = ray.get_runtime_context().get_node_id()
        self._inbox: queue.Queue = queue.Queue()
        self._channels: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}  # request id -> channel id
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's, known at first call
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ actor API
    def info(self) -> HostInfo:
        e = self.engine
        return HostInfo(self.node_id, self.host_index, e.loaded.name, e.max_model_len,
                        e.loaded.config.vocab_size, e.block_manager.num_total_blocks,
                        e.config.cache.block_size)

    async def submit(self, channel: str, specs: list[GenerateSpec]) -> list[str | None]:
        """Queue requests; returns an error message per spec (None when accepted)."""
        if self._error is not None:
            raise HostError(self._error)
        self._open(channel)
        errors: list[str | None] = []
        for spec in specs:
            try:
                self.engine.validate_prompt(list(spec.prompt_token_ids))
            except ValueError as exc:
                errors.append(str(exc))
                continue
            errors.append(None)
            self._owner[spec.request_id] = channel
            self._inbox.put(("add", spec))
        return errors

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        # Read across threads: each field is a plain read, good enough for gauges.
        return self.engine.stats()

    async def outputs(self, channel: str) -> AsyncIterator[list[TokenDelta]]:
        """A router's stream of token deltas for the requests it submitted on ``channel``."""
        out = self._open(channel)
        try:
            while True:
                batch = list(await out.get())
                while not out.empty():  # coalesce whatever else is ready
                    batch.extend(out.get_nowait())
                failure = next((d for d in batch if isinstance(d, HostError)), None)
                if failure is not None:
                    raise failure
                yield batch
        finally:
            self._channels.pop(channel, None)

    def _open(self, channel: str) -> asyncio.Queue:
        self._loop = asyncio.get_running_loop()
        return self._channels.setdefault(channel, asyncio.Queue())

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._drain_inbox(block=not engine.has_unfinished)
                if not engine.has_unfinished:
                    continue
                deltas = engine.step()
                if deltas:
                    self._publish(deltas)
        except Exception as exc:  # a bug or a device failure: fail every stream loudly
            logger.exception("engine failed")
            self._error = f"host {self.host_index} engine failed: {exc!r}"
            for channel in list(self._channels.values()):
                self._post(channel, [HostError(self._error)])

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                self.engine.add_request(value.request_id, list(value.prompt_token_ids),
                                        value.params, value.sample_index)
            else:
                self.engine.abort(value)
                self._owner.pop(value, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _publish(self, deltas: list[TokenDelta]) -> None:
        by_channel: dict[str, list[TokenDelta]] = {}
        for delta in deltas:
            channel = self._owner.get(delta.request_id)
            if channel is None:
                continue  # aborted meanwhile
            by_channel.setdefault(channel, []).append(delta)
            if delta.finish_reason is not None:
                self._owner.pop(delta.request_id, None)
        for channel_id, batch in by_channel.items():
            channel = self._channels.get(channel_id)
            if channel is not None:
                self._post(channel, batch)

    def _post(self, channel: asyncio.Queue, batch: list) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(channel.put_nowait, batch)
