"""``EngineClient``: one process's connection to the ``Engine`` deployment.

Every sequence is placed on its own by this process's ``EngineRouter`` (by load and prefix). It
goes through the deployment's handle the first time a replica is chosen, and straight to that
replica's lead host (one actor call) once this client streams from it. The tokens of all of them
come back over one Ray stream per engine replica in use, straight from its lead host: each item
of that stream is everything one or more engine steps produced for this client (on a channel of
its own), which it fans out to its sequences here, in-process. Token traffic is therefore one
message per engine step per client (the ingress has one per process), whatever the number of
sequences, and no Serve replica relays it.

A sequence whose replica fails before it produced a token is submitted again (the router skips
the failed replica); one that had started ends with ``ReplicaFailed``. A sequence sent to a
replica that Serve is stopping (its lead drains and takes nothing new) goes to another replica
too; only where none is left does the caller hear ``ServerDraining``. For as long as the client
streams from a replica (the stream stays open between sequences, so the next one needs no Serve
call) it renews its lease at the lead every ``KEEPALIVE_S``; if its process dies (or its event
loop ends), the lead aborts its sequences once the lease runs out.

The HTTP ingress uses one per replica; a Ray program can use one too::

    client = EngineClient(serve.get_deployment_handle("Engine", app_name="meshserve"))
    async for deltas in client.stream(spec):
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator

from meshserve.actors.channel import next_batch
from meshserve.actors.messages import (Completion, GenerateSpec, HostError, RequestRejected,
                                       SequenceError, ServerDraining)
from meshserve.contracts.tokens import TokenDelta
from meshserve.actors.host import KEEPALIVE_S
from meshserve.deploy.load import ReplicaGone, load_book, sequence_cost

logger = logging.getLogger("meshserve.client")

RETRY_BACKOFF_S = 0.2


class ReplicaFailed(RuntimeError):
    """The engine replica serving a sequence failed (or its stream broke)."""


class ReplicaRetiring(ReplicaFailed, ServerDraining):
    """The replica chosen for a sequence is leaving (Serve stops it; its lead drains): the
    sequence is placed again, and if it was the last replica the server is shutting down."""


def replica_lost(exc: BaseException) -> bool:
    """Does ``exc`` say the replica (not the request) is gone?"""
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                            ReplicaGone))


class EngineClient:
    """One client's sequences on the ``Engine`` deployment, over one stream per replica."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.book = load_book(handle.app_name, handle.deployment_name)
        self.channel = self.book.new_channel()
        self._sequences: dict[str, asyncio.Queue] = {}  # request id -> its deltas
        self._replica_of: dict[str, str] = {}  # request id -> engine replica id
        self._leads: dict[str, object] = {}  # engine replica id -> its lead host's actor handle
        self._pumps: dict[str, asyncio.Task] = {}  # engine replica id -> its stream's reader
        self._keepalive: asyncio.Task | None = None

    # ------------------------------------------------------------------ sequences
    async def generate(self, spec: GenerateSpec) -> Completion:
        deltas = [d async for batch in self.stream(spec) for d in batch]
        return Completion.from_deltas(spec.request_id, deltas)

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        """The deltas of one sequence, in batches; the last carries a finish reason. Closing the
        iterator early aborts the sequence on its replica."""
        attempts = len(self.replica_ids()) + 1
        for attempt in range(attempts):
            produced = False
            try:
                # Closed explicitly: this generator's own close must abort the sequence now,
                # not whenever the inner one is collected.
                async with contextlib.aclosing(self._run(spec)) as run:
                    async for batch in run:
                        produced = True
                        yield batch
                return
            except ReplicaFailed:
                if produced or attempt == attempts - 1:
                    raise
                logger.warning("retrying %s on another replica", spec.request_id)
                # Give Serve (and this process's pumps) a moment to see the replica gone.
                await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))

    async def _run(self, spec: GenerateSpec) -> AsyncIterator[list[TokenDelta]]:
        request_id = spec.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self._sequences[request_id] = queue
        replica_id = None
        finished = False
        try:
            try:
                replica_id, lead, error = await self._submit(spec)
            except Exception as exc:
                if replica_lost(exc):
                    gone = getattr(exc, "replica_id", None)  # a ReplicaGone names the replica
                    if gone is not None:
                        self.book.mark_failed(gone)
                    raise ReplicaFailed(f"an engine replica is unavailable: {exc}") from None
                raise
            if error is not None:
                raise RequestRejected(error)
            self._replica_of[request_id] = replica_id
            self.book.hold(request_id, replica_id, sequence_cost(spec))
            self._open(replica_id, lead)
            while not finished:
                batch = await next_batch(queue)
                if isinstance(batch[-1], SequenceError):
                    finished = True  # ended there: nothing to abort
                    raise batch[-1].error
                finished = batch[-1].finish_reason is not None
                yield batch
        finally:
            self._sequences.pop(request_id, None)
            self._replica_of.pop(request_id, None)
            self.book.release(request_id)
            if not finished and replica_id in self._pumps:
                # The caller left, or a stop string ended it here: free its blocks there now.
                self._leads[replica_id].abort.remote([request_id])

    async def _submit(self, spec: GenerateSpec) -> tuple[str, object, str | None]:
        """Queue ``spec`` on the replica this process's router chooses; returns (its id, its lead's
        handle, an error message or None), as ``EngineReplica.submit`` does.

        Straight to the lead when this process already streams from that replica; otherwise
        through the handle, pinned to it (the replica answers with its lead). Before this
        process's first call through the handle no router has started: the handle chooses.
        """
        placer = self.book.placer
        if placer is None:
            return await self._call("submit", self.channel, spec)
        replica_id = placer(spec)
        lead = self._leads.get(replica_id)
        try:
            if lead is None:
                return await self._call("submit", self.channel, spec, replica_id=replica_id)
            error = (await lead.submit.remote(self.channel, [spec]))[0]
        except Exception as exc:
            if isinstance(exc, ServerDraining):  # chosen before this process saw it leave
                self.book.mark_failed(replica_id)
                raise ReplicaRetiring(f"engine replica {replica_id} is retiring") from None
            if lead is not None and (isinstance(exc, HostError) or replica_lost(exc)):
                # the engine stopped, or its host
                raise ReplicaGone(f"engine replica {replica_id} failed: "
                                  f"{getattr(exc, 'cause', exc)}", replica_id) from None
            raise
        return replica_id, lead, error

    def abort(self, request_ids: list[str]) -> None:
        """Abort sequences of this client wherever they run."""
        for request_id in request_ids:
            replica_id = self._replica_of.get(request_id)
            if replica_id in self._leads:
                self._leads[replica_id].abort.remote([request_id])

    # ------------------------------------------------------------------ replicas
    def replica_ids(self) -> list[str]:
        """The engine replicas this process's router currently sees."""
        return sorted(self.book.replica_ids)

    async def each_replica(self, method: str, *args) -> list:
        """Call ``method`` on every engine replica; a replica that fails to answer is left out."""
        async def one(replica_id: str):
            try:
                return await self._call(method, *args, replica_id=replica_id)
            except Exception as exc:  # noqa: BLE001 - it died or is restarting
                logger.info("engine replica %s did not answer %s: %r", replica_id, method, exc)
                return None

        answers = await asyncio.gather(*(one(r) for r in self.replica_ids()))
        return [a for a in answers if a is not None]

    def _call(self, method: str, *args, **kwargs):
        """``handle.method.remote(...)``, made outside the current Serve request's context.

        Inside a replica, calls inherit the request's internal id, so the sequences of one HTTP
        request would all share one; Serve matches a routing decision to its call by that id, and
        siblings sharing it wait forever. A fresh context gives each call its own.
        """
        return contextvars.Context().run(getattr(self.handle, method).remote, *args, **kwargs)

    def _open(self, replica_id: str, lead) -> None:
        if replica_id not in self._pumps:
            self._leads[replica_id] = lead
            self._pumps[replica_id] = asyncio.get_running_loop().create_task(
                self._pump(replica_id, lead))
        if self._keepalive is None:
            self._keepalive = asyncio.get_running_loop().create_task(self._renew())

    async def _pump(self, replica_id: str, lead) -> None:
        """Fan this process's stream from one replica's lead out to the sequences, until the
        replica leaves (Serve stopped it: the stream ends) or fails."""
        try:
            stream = lead.outputs.options(num_returns="streaming").remote(self.channel)
            async for ref in stream:
                batch = await ref
                by_sequence: dict[str, list] = {}
                for item in batch:
                    by_sequence.setdefault(item.request_id, []).append(item)
                for request_id, items in by_sequence.items():
                    queue = self._sequences.get(request_id)
                    if queue is not None:
                        queue.put_nowait(items)
            logger.info("engine replica %s left", replica_id)
            failure = ReplicaFailed(f"engine replica {replica_id} left")
        except Exception as exc:  # noqa: BLE001 - the replica died or its engine failed
            logger.error("engine replica %s failed: %r", replica_id, exc)
            failure = ReplicaFailed(f"engine replica {replica_id} failed: {exc}")
        finally:
            self._pumps.pop(replica_id, None)
            self._leads.pop(replica_id, None)
        # Sequences still placed there (none, after a replica's orderly exit) end, or, without
        # a token yet, are placed again elsewhere.
        self.book.mark_failed(replica_id)
        for request_id, owner in list(self._replica_of.items()):
            queue = self._sequences.get(request_id)
            if owner == replica_id and queue is not None:
                queue.put_nowait([failure])

    async def _renew(self) -> None:
        """Keep this process's leases on the replicas it streams from."""
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            for lead in list(self._leads.values()):
                try:
                    lead.keepalive.remote(self.channel)
                except Exception as exc:  # noqa: BLE001 - the next round tries again
                    logger.warning("keep-alive to an engine replica failed: %r", exc)
