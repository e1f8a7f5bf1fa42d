"""Which engine replica takes a sequence: a Ray Serve ``RequestRouter`` in every caller's handle.

The ``Engine`` deployment names ``EngineRouter`` in its ``request_router_config``, so every
``DeploymentHandle`` to it (each HTTP ingress replica's, a Ray program's) runs this policy in its
own process; no central router carries requests or tokens.

The policy, per sequence (a call whose first argument, or second for ``submit``, is a
``GenerateSpec``):

- **Load**: each replica's tokens owed, that is prompt plus ``max_tokens`` of every sequence still
  running there. This process knows its own exactly (``LoadBook``); the rest comes from what each
  replica reports through ``record_routing_stats`` (per caller, so a caller counts itself once).
- **Prefix affinity**: a prompt longer than ``AFFINITY_BLOCKS`` KV blocks goes to the replica that
  its leading blocks hash to (rendezvous hashing over the replica ids, the same in every process),
  so prompts sharing a prefix meet the same prefix cache, unless that replica carries more than
  ``AFFINITY_SLACK`` times the lightest load with the new sequence added to it.
- Otherwise the lightest replica; of equals, the one this router chose least recently, so idle
  replicas take turns.

Each router also publishes ``place`` in its process's ``LoadBook``: an ``EngineClient`` that
already streams from the chosen replica submits there directly, so a sequence costs one actor call
instead of a Serve call plus the replica's own call to its lead; the choice is the same one, made
by the same router from the same state.

A call with a ``replica_id`` keyword goes to that replica only (a caller's output stream,
keep-alives, aborts and stats); if it is gone, the call fails at once with ``ReplicaGone``.
Replicas whose stream failed in this process are skipped for a while (``LoadBook.mark_failed``),
before Serve itself has noticed.

Serve ships this module to every caller by value (a copy of its globals per router), so state
shared with the rest of the process lives in ``load.py``, which is imported by name.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from meshserve.actors.messages import GenerateSpec
from meshserve.deploy.load import ReplicaGone, load_book, sequence_cost, spec_of

AFFINITY_BLOCKS = 4  # prompts sharing this many leading KV blocks are steered together
AFFINITY_SLACK = 2.0  # ...unless that replica carries more than this times the lightest load


class EngineRouter(RequestRouter):
    """Least tokens owed with prefix-cache affinity; see the module docstring."""

    def initialize_state(self, block_size: int = 16) -> None:
        self._book = load_book(self._deployment_id.app_name, self._deployment_id.name)
        self._affinity_tokens = AFFINITY_BLOCKS * block_size
        self._picks = itertools.count()
        self._last_pick: dict[str, int] = {}  # replica id -> when this router last chose it
        self._direct: dict[str, str] = {}  # internal request id -> sequence id (generate calls)
        # Serve runs this router on a thread of its own; clients call ``place`` from theirs.
        self._lock = threading.Lock()
        self._book.placer = self.place

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with self._lock:
            self._book.replica_ids = frozenset(r.replica_id.unique_id for r in replicas)
            self._last_pick = {k: v for k, v in self._last_pick.items()
                               if k in self._book.replica_ids}

    def place(self, spec: GenerateSpec) -> str | None:
        """Choose the replica for ``spec`` among those this router sees and count the sequence
        against it in the ``LoadBook``; None while it sees none."""
        candidates = list(self.curr_replicas.values())
        return self._choose(candidates, spec)[0].replica_id.unique_id if candidates else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Without this, a pass that finds every candidate full retries at once, forever.
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get("replica_id")
        if target is not None:
            return self._pinned(candidate_replicas, pending_request, target)
        spec = spec_of(pending_request)
        if spec is None:
            return [self._live(candidate_replicas)]
        ranked = self._choose(candidate_replicas, spec)
        if pending_request.metadata.call_method != "submit":  # released when the call ends
            self._direct[pending_request.metadata.internal_request_id] = spec.request_id
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]

    def _live(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates whose stream has not failed in this process (all, if every one has)."""
        live = [r for r in candidates if not self._book.failed(r.replica_id.unique_id)]
        return live or candidates

    def _choose(self, candidates: list[RunningReplica], spec: GenerateSpec
                ) -> list[RunningReplica]:
        """``candidates`` best first for ``spec``; the first is recorded as chosen and holds it."""
        with self._lock:
            ranked = self._rank(self._live(candidates), spec)
            chosen = ranked[0].replica_id.unique_id
            self._last_pick[chosen] = next(self._picks)
        self._book.hold(spec.request_id, chosen, sequence_cost(spec))
        return ranked

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        key = self._direct.pop(internal_request_id, None)
        if key is not None:
            self._book.release(key)

    @staticmethod
    def _pinned(candidates: list[RunningReplica], request: PendingRequest,
                target: str) -> list[list[RunningReplica]]:
        for replica in candidates:
            if replica.replica_id.unique_id == target:
                return [[replica]]
        # Fail the call instead of waiting for a replica that will not come back; routing stops
        # as soon as it sees the request settled.
        if not request.future.done():
            request.future.set_exception(ReplicaGone(f"engine replica {target} is gone", target))
        return [candidates[:1]]

    def _load(self, replica: RunningReplica) -> int:
        """Tokens owed on ``replica``: this process's own, plus what it reports for others."""
        reported = (replica.routing_stats or {}).get("owed_tokens", {})
        return self._book.owed(replica.replica_id.unique_id) + self._book.others(reported)

    def _rank(self, candidates: list[RunningReplica], spec: GenerateSpec) -> list[RunningReplica]:
        """Candidates best first: the affine replica if its load allows, then by load."""
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        loads = {r.replica_id.unique_id: self._load(r) for r in ordered}
        # Ties go to the replica this router chose least recently. (Not a turn counter: the
        # caller may see a call's result before Serve tells the router it ended, so the
        # previous sequence can still count as load, which would knock a counter's order off.)
        by_load = sorted(ordered, key=lambda r: (loads[r.replica_id.unique_id],
                                                 self._last_pick.get(r.replica_id.unique_id, -1)))
        tokens = spec.prompt_token_ids
        if len(tokens) <= self._affinity_tokens:
            return by_load
        prefix = array("q", tokens[:self._affinity_tokens]).tobytes()
        home = max(ordered, key=lambda r: hashlib.blake2b(
            prefix + r.replica_id.unique_id.encode(), digest_size=8).digest())
        # The slack covers the new sequence too: on idle replicas, a load report taken while
        # this caller's previous sequence still ran at home must not send the next elsewhere.
        lightest = loads[by_load[0].replica_id.unique_id]
        if loads[home.replica_id.unique_id] <= AFFINITY_SLACK * (lightest + sequence_cost(spec)):
            return [home] + [r for r in by_load if r is not home]
        return by_load
