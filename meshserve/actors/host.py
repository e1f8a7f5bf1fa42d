"""Host actors: the Ray actors that own one host's engine.

``HostActor`` serves: its engine runs in its own thread, stepping while there is work and sleeping
on its inbox when there is none, so the actor's asyncio loop stays free to take requests, aborts
and stats calls. Results leave through per-subscriber output channels: one Ray streaming call per
router, each item a batch of token deltas from one or more steps, instead of one message per
token. Ray programs can also call it directly (``generate`` / ``generate_stream``), which is how
batch jobs use a host without Serve.

In a multi-host replica the ``HostActor`` is the lead and the other hosts are ``FollowerHost`` s
(see ``lockstep.py``); both share ``EngineHost`` (``engine_host.py``) for what every host does.
What they send each other is in ``messages.py``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from meshserve.actors.channel import next_batch
from meshserve.actors.engine_host import EngineHost
from meshserve.actors.lockstep import Lockstep
from meshserve.actors.messages import Completion, GenerateSpec, HostError
from meshserve.config import EngineConfig
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.tokens import EngineStats, TokenDelta

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger("meshserve.host")


class HostActor(EngineHost):
    """Owns an engine on one host and serves it. Start it with ``start_host`` (or
    ``ray.remote(HostActor)``); ``followers`` are the other hosts of a multi-host replica."""

    def __init__(self, config: EngineConfig, host_index: int = 0,
                 num_threads: int | None = None, followers: Sequence = ()) -> None:
        super().__init__(config, host_index, num_threads)
        self._lockstep = Lockstep(followers) if followers else None
        self._inbox: queue.Queue = queue.Queue()
        self._channels: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}  # request id -> channel id
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's, known at first call
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ router API
    async def submit(self, channel: str, specs: list[GenerateSpec]) -> list[str | None]:
        """Queue requests; returns an error message per spec (None when accepted)."""
        if self._error is not None:
            raise HostError(self._error)
        self._open(channel)
        errors: list[str | None] = []
        for spec in specs:
            try:
                if spec.request_id in self._owner:
                    raise ValueError(f"request_id {spec.request_id!r} is already in use")
                self.engine.prompt_limits.check(spec.prompt_token_ids)
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
        # Read live across threads (each field is a plain read): after an abort the engine
        # idles, so a snapshot taken per step would go stale.
        return self.engine.stats()

    async def outputs(self, channel: str) -> AsyncIterator[list[TokenDelta]]:
        """A router's stream of token deltas for the requests it submitted on ``channel``."""
        out = self._open(channel)
        try:
            while True:
                yield await next_batch(out)
        finally:
            self._channels.pop(channel, None)

    # ------------------------------------------------------------------ direct API
    async def generate_stream(self, prompt_token_ids: Sequence[int],
                              params: SamplingParams | None = None,
                              request_id: str | None = None) -> AsyncIterator[list[TokenDelta]]:
        """Stream one sequence's token deltas; the last carries a finish reason.

        Call it with ``.options(num_returns="streaming")``. Invalid prompts raise ValueError;
        closing the stream early aborts the request.
        """
        spec = GenerateSpec(request_id or uuid.uuid4().hex, tuple(prompt_token_ids),
                            params or SamplingParams())
        if spec.request_id in self._owner:  # before its channel exists, which would be shared
            raise ValueError(f"request_id {spec.request_id!r} is already in use")
        channel = f"direct-{spec.request_id}"  # a private channel: its one reader is this call
        out = self._open(channel)
        finished = False
        try:
            error = (await self.submit(channel, [spec]))[0]
            if error is not None:
                raise ValueError(error)
            while not finished:
                batch = await next_batch(out)
                finished = batch[-1].finish_reason is not None
                yield batch
        finally:
            self._channels.pop(channel, None)
            if not finished:
                self.abort([spec.request_id])

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> Completion:
        """Generate one sequence to the end. Concurrent calls share the engine's batch."""
        deltas = [d async for batch in self.generate_stream(prompt_token_ids, params, request_id)
                  for d in batch]
        return Completion.from_deltas(deltas[0].request_id, deltas)

    # ------------------------------------------------------------------ channels
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
                deltas = self._step()
                if deltas:
                    self._publish(deltas)
        except Exception as exc:  # a bug, a device failure or a lost follower: fail loudly
            logger.exception("engine failed")
            self._error = f"host {self.host_index} engine failed: {exc}"
            for channel in list(self._channels.values()):
                self._post(channel, [HostError(self._error)])

    def _step(self) -> list[TokenDelta]:
        if self._lockstep is None:
            return self.engine.step()
        step = self.engine.schedule()  # with the grammar masks the followers apply too
        return self.engine.apply(step, self._lockstep.execute(self.engine, step))

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


def start_host(config: EngineConfig | None = None, *, num_cpus: float = 1.0,
               **actor_options) -> ActorHandle:
    """Start one ``HostActor`` on the connected Ray cluster and return its handle.

    ``actor_options`` go to ``.options()`` (``resources``, ``scheduling_strategy``, ``name``...).
    The handle is usable at once; calls wait until the engine has loaded.
    """
    import ray

    return ray.remote(HostActor).options(num_cpus=num_cpus, **actor_options).remote(
        config or EngineConfig())
