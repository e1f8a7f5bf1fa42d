"""Host actors: the engine of one host, served from its own thread.

``HostActor`` builds its engine and steps it in one thread of its own while there is work; that
thread sleeps on its inbox when there is none, hands each step's deltas to the event loop in one
call and never waits for it, and torch releases the GIL while it computes. The event loop takes
requests, aborts and stats calls and does the bookkeeping: who owns which request, and which
channel each delta goes to.

Results leave through output channels: a subscriber (an HTTP ingress replica, through
``meshserve.deploy.client.EngineClient``) submits any number of sequences on one channel and reads
one Ray stream of batches for all of them (``outputs``), each batch everything one or more steps
produced for that channel. A subscriber holds a lease on its channel (``keepalive``); a channel
unheard of for ``LEASE_S`` belongs to a caller that died (Ray does not end a stream whose reader
is gone), so its requests are aborted and their KV blocks freed. Ray programs can also call a
host directly (``generate`` / ``generate_stream``), which is how batch jobs use a host without
Serve; each replica of the Serve ``Engine`` deployment (``meshserve.deploy.engine``) owns one.

In a multi-host replica the ``HostActor`` is the lead and the other hosts are ``FollowerHost`` s
(see ``lockstep.py``); both share ``EngineHost`` (``engine_host.py``) for what every host does.
What they send each other is in ``messages.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from meshserve.actors.channel import next_batch
from meshserve.actors.engine_host import EngineHost
from meshserve.actors.lockstep import Lockstep, agree_on_kv_cache
from meshserve.actors.messages import (ChannelClosed, Completion, GenerateSpec, HostError,
                                       RouterOverloaded, SequenceError, ServerDraining,
                                       direct_channel)
from meshserve.config import EngineConfig
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.tokens import EngineStats, TokenDelta

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger("meshserve.host")

LEASE_S = 15.0  # a subscriber silent this long is gone; EngineClient renews every KEEPALIVE_S
KEEPALIVE_S = 1.0
# How often ``stopped`` looks at the engine, inside this process: a lockstep step stuck past its
# deadline raises nowhere, so it can only be found by looking.
STOP_CHECK_S = 0.5


class HostActor(EngineHost):
    """Owns an engine on one host and serves it. Start it with ``start_host`` (or
    ``ray.remote(HostActor)``); ``followers`` are the other hosts of a multi-host replica,
    ``max_requests`` (if set) the requests it holds before ``submit`` answers
    ``RouterOverloaded``, and ``reserved_cpus`` the host's CPUs its engine leaves to the serving
    processes (``actors/cpus.py``)."""

    def __init__(self, config: EngineConfig, host_index: int = 0, reserved_cpus: int = 0,
                 followers: Sequence = (), max_requests: int | None = None) -> None:
        self._lockstep = Lockstep(followers) if followers else None
        self._inbox: queue.Queue = queue.Queue()
        # Event-loop state only: the engine thread never reads or writes it.
        self._channels: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}  # request id -> channel id, while it runs
        self._cost: dict[str, int] = {}  # request id -> tokens it may still take (for routing)
        # Aborted ids the engine thread has not dropped yet: not reusable until it has, or a
        # delta of the old request could reach the new one.
        self._aborting: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's, known at first call
        self._max_requests = max_requests
        self._leases: dict[str, float] = {}  # leased channel -> when its subscriber was heard of
        self._sweeper: asyncio.Task | None = None
        self._draining = False
        self._retired = False  # its replica is leaving: output streams end once emptied
        self._error: str | None = None
        # The engine is built, warmed up and stepped on this one thread. OpenMP keeps a thread
        # pool per thread that enters a parallel region; with a second pool (the constructor's)
        # the runtime counts more threads than cores and stops spinning between regions, which
        # cost a fifth of a CPU engine's throughput (offline on 2 cores: 107.6 against 135.5
        # tok/s).
        built = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(built, config, host_index, reserved_cpus, followers),
            name="engine", daemon=True)
        self._thread.start()
        built.result()  # a failed build raises here, as a constructor's error

    # ------------------------------------------------------------------ subscriber API
    async def submit(self, channel: str, specs: list[GenerateSpec]) -> list[str | None]:
        """Queue requests whose deltas go to ``channel`` (whose lease this renews); returns an
        error message per spec (None when accepted)."""
        if self._draining:
            raise ServerDraining("the server is shutting down")
        if self._max_requests is not None and len(self._owner) + len(specs) > self._max_requests:
            raise RouterOverloaded(f"{len(self._owner)} requests in flight")
        self.keepalive(channel)
        return self._submit(channel, specs)

    def _submit(self, channel: str, specs: list[GenerateSpec]) -> list[str | None]:
        if self._error is not None:
            raise HostError(self._error)
        self._open(channel)
        errors: list[str | None] = []
        for spec in specs:
            try:
                if spec.request_id in self._owner or spec.request_id in self._aborting:
                    raise ValueError(f"request_id {spec.request_id!r} is already in use")
                self.engine.prompt_limits.check(spec.prompt_token_ids)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            errors.append(None)
            self._owner[spec.request_id] = channel
            self._cost[spec.request_id] = len(spec.prompt_token_ids) + spec.params.max_tokens
            self._inbox.put(("add", spec))
        return errors

    def keepalive(self, channel: str) -> None:
        """Renew the lease of ``channel``'s subscriber."""
        self._leases[channel] = time.monotonic()
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            cutoff = time.monotonic() - LEASE_S
            for channel in [c for c, seen in self._leases.items() if seen < cutoff]:
                del self._leases[channel]
                aborted = self.close_channel(channel)
                if aborted:
                    logger.warning("subscriber %s went silent: aborted its %d requests", channel,
                                   aborted)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._owner.pop(request_id, None) is not None:
                self._cost.pop(request_id, None)
                self._aborting.add(request_id)
                self._inbox.put(("abort", request_id))

    def close_channel(self, channel: str) -> int:
        """Abort every request of ``channel`` and drop it (its reader is gone); returns how many
        requests it held. A reader still attached after all sees ``ChannelClosed``."""
        owned = [r for r, c in self._owner.items() if c == channel]
        self.abort(owned)
        out = self._channels.pop(channel, None)
        if out is not None:
            out.put_nowait([ChannelClosed(f"channel {channel} closed: its reader went silent")])
        return len(owned)

    def cancel_all(self, error: BaseException) -> int:
        """End every running request with ``error`` on its channel (the channels stay open) and
        abort it; returns how many there were."""
        owned = list(self._owner.items())
        for request_id, channel in owned:
            out = self._channels.get(channel)
            if out is not None:
                out.put_nowait([SequenceError(request_id, error)])
        self.abort([request_id for request_id, _ in owned])
        return len(owned)

    def stats(self) -> EngineStats:
        # Read live across threads (each field is a plain read): after an abort the engine
        # idles, so a snapshot taken per step would go stale.
        return self.engine.stats()

    def load(self) -> dict:
        """Requests held, and per channel the tokens they may still take (prompt + max_tokens),
        for routing."""
        owed: dict[str, int] = {}
        for request_id, channel in self._owner.items():
            owed[channel] = owed.get(channel, 0) + self._cost.get(request_id, 0)
        return {"requests": len(self._owner), "owed_tokens": owed}

    def health(self) -> None:
        """Raise ``HostError`` if the engine stopped or is stuck."""
        if self.failure is not None:
            raise HostError(self.failure)

    async def stopped(self) -> str:
        """Wait until the engine stops or gets stuck; return why (what ``health`` would raise).

        A supervisor keeps one call pending instead of asking ``health`` over Ray twice a second:
        the waiting costs a timer here, and if this actor dies, the caller's pending call fails
        with ``RayActorError`` at once."""
        while (failure := self.failure) is None:
            await asyncio.sleep(STOP_CHECK_S)
        return failure

    async def drain(self, timeout_s: float) -> dict:
        """Take no new requests; let running ones finish for up to ``timeout_s``, then end the
        rest (their channels get a ``SequenceError``); return what happened."""
        self._draining = True
        running = len(self._owner)
        deadline = time.monotonic() + timeout_s
        while self._owner and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cancelled = self.cancel_all(ServerDraining("the server is shutting down"))
        return {"in_flight": running, "finished": running - cancelled, "cancelled": cancelled}

    async def retire(self, timeout_s: float) -> dict:
        """Leave service in good order (Serve is stopping this replica): ``drain`` for up to
        ``timeout_s``, then end every output stream once its reader has what was queued, so that
        callers see the replica leave, not fail; return what ``drain`` did."""
        outcome = await self.drain(timeout_s)
        self._retired = True
        for out in self._channels.values():
            out.put_nowait([])  # wakes a reader waiting on an empty channel
        return outcome

    @property
    def failure(self) -> str | None:
        """Why the engine stopped or is stuck (it takes no more work), or None while it serves."""
        if self._error is None and not self._thread.is_alive():
            return f"host {self.host_index}: the engine thread has exited"
        if self._error is None and self._lockstep is not None:
            return self._lockstep.stall()  # a step run past its deadline cannot raise by itself
        return self._error

    async def outputs(self, channel: str) -> AsyncIterator[list[TokenDelta]]:
        """The stream of token deltas for the requests submitted on ``channel`` (call it with
        ``.options(num_returns="streaming")``); it ends only once the host has retired."""
        self.keepalive(channel)
        out = self._open(channel)
        try:
            while not (self._retired and out.empty()):
                batch = await next_batch(out)
                if batch:
                    yield batch
        finally:
            if self._channels.get(channel) is out:
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
        async for batch in self.stream_spec(spec):
            yield batch

    async def stream_spec(self, spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        """``generate_stream`` for a ready-made ``GenerateSpec``."""
        if self._draining:
            raise ServerDraining("the server is shutting down")
        if spec.request_id in self._owner or spec.request_id in self._aborting:
            # refused before its channel exists, which would be shared
            raise ValueError(f"request_id {spec.request_id!r} is already in use")
        channel = direct_channel(spec.request_id)  # private: its one reader is this call
        out = self._open(channel)
        finished = False
        try:
            error = self._submit(channel, [spec])[0]
            if error is not None:
                raise ValueError(error)
            while not finished:
                batch = await next_batch(out)
                if isinstance(batch[-1], SequenceError):
                    raise batch[-1].error
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

    # ------------------------------------------------------------------ channels (event loop)
    def _open(self, channel: str) -> asyncio.Queue:
        self._loop = asyncio.get_running_loop()
        return self._channels.setdefault(channel, asyncio.Queue())

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        """One step's deltas, split into one batch per channel (on the event loop)."""
        by_channel: dict[str, list[TokenDelta]] = {}
        owner, cost = self._owner, self._cost
        for delta in deltas:
            channel = owner.get(delta.request_id)
            if channel is None:
                continue  # aborted meanwhile
            by_channel.setdefault(channel, []).append(delta)
            if delta.finish_reason is not None:
                del owner[delta.request_id]
                cost.pop(delta.request_id, None)
        for channel_id, batch in by_channel.items():
            out = self._channels.get(channel_id)
            if out is not None:
                out.put_nowait(batch)

    def _fail(self, error: str) -> None:
        self._error = error
        for out in self._channels.values():
            out.put_nowait([HostError(error)])
        self._owner.clear()
        self._cost.clear()

    # ------------------------------------------------------------------ engine thread
    def _serve(self, built: concurrent.futures.Future, config: EngineConfig, host_index: int,
               reserved_cpus: int, followers: Sequence) -> None:
        """The engine thread: build the engine (and agree on its cache with the followers), then
        step it for as long as the actor lives."""
        try:
            super().__init__(config, host_index, reserved_cpus, allocate=not followers)
            if followers:  # every host has measured its memory; all allocate the smallest figure
                agree_on_kv_cache(self.engine, followers)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            built.set_exception(exc)
            return
        built.set_result(None)
        self._run()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._drain_inbox(block=not engine.has_unfinished)
                if not engine.has_unfinished:
                    continue
                deltas = self._step()
                if deltas and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._deliver, deltas)
        except Exception as exc:  # a bug, a device failure or a lost follower: fail loudly
            logger.exception("engine failed")
            error = f"host {self.host_index} engine failed: {exc}"
            self._error = error
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail, error)

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
                self._loop.call_soon_threadsafe(self._aborting.discard, value)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return


def start_host(config: EngineConfig | None = None, *, num_cpus: float = 1.0,
               reserved_cpus: int = 0, **actor_options) -> ActorHandle:
    """Start one ``HostActor`` on the connected Ray cluster and return its handle.

    ``reserved_cpus``: CPUs of its node the engine leaves to other processes (``actors/cpus.py``;
    ``info().engine_cpus`` says which it took). ``actor_options`` go to ``.options()``
    (``resources``, ``scheduling_strategy``, ``name``...). The handle is usable at once; calls
    wait until the engine has loaded.
    """
    import ray

    return ray.remote(HostActor).options(num_cpus=num_cpus, **actor_options).remote(
        config or EngineConfig(), reserved_cpus=reserved_cpus)
