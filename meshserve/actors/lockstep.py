"""Multi-host replicas: the lead schedules, every host runs the same step, in lockstep.

A replica that spans several hosts is multi-controller SPMD: every host runs the same program on
the same inputs. The lead ``HostActor`` owns the only scheduler that matters; each step goes to
every ``FollowerHost`` in two phases:

1. **Prepare.** Every host takes the step into its runner and fingerprints what it is about to
   run (``prepare_step``), part by part: the step as received (requests, blocks, tokens, grammar
   masks) and the runner's own layout of it (token ids and positions, KV writes, attention
   tables, sampled rows, sampling parameters and random draws, digested) with the compiled
   programs it picked (token bucket, request bucket, sampler variant). The lead compares each
   follower's fingerprint with its own *before anyone executes*: on a TPU slice a host that runs
   a different program, or the same program on different inputs, does not fail, it hangs the
   slice's collectives forever. A difference fails the replica with a message naming the part.
2. **Run.** Every host executes its prepared step; the lead then checks that each follower
   sampled exactly the tokens it did. Tokens reach clients from the lead only.

Every wait has a deadline (``ParallelConfig.step_deadline_s``): a follower that does not answer
in time (frozen, hung, deadlocked) fails the replica as surely as one that answers wrong, so a
request never waits on a lost host for longer than that. The lead's own run of a step cannot be
interrupted (on a slice it may sit in a collective that a lost host never joins), so
``Lockstep.stall`` reports one that outlasts the deadline to the replica's health check, which
then replaces the replica, process and all. A follower that differs, raises, dies or
is late fails the whole replica with a ``HostError``: a replica whose hosts disagree is producing
garbage, so it must never carry on quietly.

Before the first step the hosts agree on one KV cache size (``agree_on_kv_cache``): each
measures what its memory holds after loading the weights, and all allocate the smallest figure.

What each host computes differs by machine. On CPU hosts every host runs the whole model on its
own copy of the weights and KV cache, so the replica is no faster than one host: the lockstep is
real, the parallelism is not. On a TPU slice, torch_xla's multi-host SPMD runs one program over
all the slice's chips; each host's process feeds the same inputs and the collectives between its
chips and the other hosts' do the splitting.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshserve.actors.engine_host import EngineHost
from meshserve.actors.messages import HostError, HostInfo
from meshserve.contracts.step import RunnerOutput, SchedulerOutput

from meshserve.config import EngineConfig

if TYPE_CHECKING:
    from meshserve.engine.engine import EngineCore
    from meshserve.runner.inputs import PreparedStep

logger = logging.getLogger("meshserve.lockstep")

Fingerprint = dict[str, str]


def _digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def step_fingerprint(step: SchedulerOutput) -> Fingerprint:
    """What a host is about to run, part by part: a short summary and a digest of each."""
    new, running = step.new_requests, step.running_requests
    requests = [(r.request_id, r.token_ids, r.num_prompt_tokens, r.params, r.sample_index,
                 r.num_computed_tokens) for r in new]
    requests += [(r.request_id, r.num_computed_tokens) for r in running]
    blocks = [(r.request_id, r.block_ids) for r in new]
    blocks += [(r.request_id, r.new_block_ids) for r in running]
    scheduled = sorted(step.num_scheduled_tokens.items())
    grammar = step.grammar
    return {
        "step requests": f"{len(new)} new, {len(running)} running #{_digest(requests)}",
        "step blocks": f"#{_digest(blocks)}",
        "step tokens": f"{step.total_num_scheduled_tokens} #{_digest(scheduled)}",
        "step finished": f"{len(step.finished_request_ids)} "
                         f"#{_digest(sorted(step.finished_request_ids))}",
        "step grammar": "none" if grammar is None else
                        f"{len(grammar.request_ids)} rows "
                        f"#{_digest(grammar.request_ids, grammar.bitmask.tobytes())}",
    }


def prepare_step(engine: EngineCore, step: SchedulerOutput
                 ) -> tuple[Fingerprint, PreparedStep | None]:
    """Take the step into this host's runner and say what it would run: the step's parts and
    the runner's (its inputs, digested, and the compiled programs it picked). Call it once per
    step: it moves the runner's persistent batch on."""
    prepared = engine.runner.prepare(step)
    runner_parts = {"program": "nothing to compute"} if prepared is None else \
        prepared.fingerprint()
    return {**step_fingerprint(step), **runner_parts}, prepared


def run_prepared(engine: EngineCore, prepared: PreparedStep | None) -> RunnerOutput:
    return RunnerOutput({}) if prepared is None else engine.runner.run(prepared)


def differences(ours: Fingerprint, theirs: Fingerprint) -> list[str]:
    """Every part a follower's fingerprint (``theirs``) disagrees with the lead's on, with both
    values; empty when they agree."""
    return [f"{part}: {theirs.get(part, 'missing')} where the lead has {ours.get(part, 'missing')}"
            for part in sorted(set(ours) | set(theirs)) if ours.get(part) != theirs.get(part)]


class FollowerHost(EngineHost):
    """A non-lead host of a multi-host replica: it holds an engine and runs the lead's steps.

    It never schedules and never talks to clients. The lead calls ``prepare`` and then ``run``
    for every step, in order (a plain actor runs one call at a time, in submission order).
    """

    _pending: tuple[int, PreparedStep | None] | None = None

    def __init__(self, config: EngineConfig, host_index: int = 0,
                 reserved_cpus: int = 0) -> None:
        # Load and place the weights, measure what is left; the lead then settles the cache size
        # (``agree_on_kv_cache``), which is why no info() is answered before allocate().
        super().__init__(config, host_index, reserved_cpus, allocate=False)

    def kv_blocks_available(self) -> int:
        return self.engine.kv_blocks_available

    def allocate(self, num_blocks: int) -> None:
        self.engine.allocate(num_blocks)

    def prepare(self, number: int, step: SchedulerOutput) -> Fingerprint:
        """Lay step ``number`` out and say what this host would run; nothing executes yet."""
        fingerprint, prepared = prepare_step(self.engine, step)
        self._pending = (number, prepared)
        return fingerprint

    def run(self, number: int) -> dict[str, int]:
        """Execute the prepared step; return the sampled token ids for the lead to compare."""
        if self._pending is None or self._pending[0] != number:
            prepared = None if self._pending is None else self._pending[0]
            raise HostError(f"host {self.host_index} was asked to run step {number} but "
                            f"prepared {prepared}")
        _, prepared = self._pending
        self._pending = None
        return run_prepared(self.engine, prepared).sampled_token_ids


class Lockstep:
    """The lead's side: prepare a step everywhere, compare, then run it everywhere and compare."""

    def __init__(self, followers: Sequence) -> None:
        self.followers = list(followers)
        self.num_steps = 0
        self._running: tuple[int, float, float] | None = None  # step, since, deadline

    def stall(self) -> str | None:
        """Why the replica is stuck, or None: the lead's own run of a step has outlasted the
        deadline. No exception can reach that thread (on a TPU slice it may be waiting in a
        collective for a host that never comes), so whoever checks health asks here."""
        running = self._running
        if running is None:
            return None
        number, since, deadline = running
        waited = time.monotonic() - since
        if waited <= deadline:
            return None
        return (f"host 0 has been running step {number} for {waited:.0f}s, past the "
                f"{deadline:g}s step deadline; the replica is stuck")

    def execute(self, engine: EngineCore, step: SchedulerOutput) -> RunnerOutput:
        number = self.num_steps + 1
        deadline = engine.config.parallel.step_deadline_s
        # Followers prepare while the lead does: the hosts work in parallel.
        fingerprints = [f.prepare.remote(number, step) for f in self.followers]
        ours, prepared = prepare_step(engine, step)
        for index, ref in enumerate(fingerprints, start=1):
            differ = differences(ours, self._get(ref, index, number, deadline))
            if differ:
                raise HostError(f"host {index} would run a different step {number} than the "
                                f"lead; the replica is out of step: {'; '.join(differ)}")
        self.num_steps = number
        runs = [f.run.remote(number) for f in self.followers]
        self._running = (number, time.monotonic(), deadline)
        try:
            output = run_prepared(engine, prepared)
        finally:
            self._running = None
        for index, ref in enumerate(runs, start=1):
            theirs = self._get(ref, index, number, deadline)
            ours_tokens = output.sampled_token_ids
            if theirs != ours_tokens:
                request_id = next(r for r in sorted(set(theirs) | set(ours_tokens))
                                  if theirs.get(r) != ours_tokens.get(r))
                raise HostError(f"host {index} fell out of step at step {number}: it "
                                f"sampled {theirs.get(request_id)} for request {request_id!r} "
                                f"where the lead sampled {ours_tokens.get(request_id)}")
        return output

    @staticmethod
    def _get(ref, index: int, number: int, deadline: float):
        import ray

        try:
            # A future, not ray.get: the lead's engine thread runs inside an async actor, where
            # Ray warns about every ray.get although the event loop is not the one waiting.
            return ref.future().result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            raise HostError(f"host {index} did not answer step {number} within {deadline:g}s "
                            "(step_deadline_s); it is hung or frozen, and the replica is out "
                            "of step") from None
        except ray.exceptions.RayError as exc:
            raise HostError(f"host {index} failed at step {number}; the replica is out of "
                            f"step: {exc}") from None


def agree_on_kv_cache(engine: EngineCore, followers: Sequence) -> int:
    """Size one KV cache for the whole replica and allocate it on every host.

    Every host has loaded its weights and measured the blocks the memory left can hold
    (``EngineCore(allocate=False)``: free HBM on a TPU, available RAM elsewhere, or an explicit
    ``num_kv_blocks``). The steps name block ids, so every host must hold the same cache: the
    replica takes the smallest figure, and every host allocates and warms up with it, all at once
    (on a slice, warm-up runs the SPMD programs, whose collectives need every host).
    Returns the block count.
    """
    counts = [engine.kv_blocks_available, *(_result(f.kv_blocks_available.remote())
                                            for f in followers)]
    blocks = min(counts)
    if len(set(counts)) > 1:
        logger.info("KV cache: %d blocks on every host, the smallest host's (host %d); the hosts "
                    "could hold %s", blocks, counts.index(blocks), counts)
    allocated = [f.allocate.remote(blocks) for f in followers]
    engine.allocate(blocks)
    for ref in allocated:
        _result(ref)
    return blocks


def _result(ref):
    # A future, not ray.get, for the same reason as in Lockstep: no warning in an async actor.
    return ref.future().result()


def check_agreement(infos: Sequence[HostInfo]) -> None:
    """Every host of a replica must hold the same cache shape: the steps name block ids."""
    lead = infos[0]
    for info in infos[1:]:
        if (info.num_total_blocks, info.max_model_len) != (lead.num_total_blocks,
                                                           lead.max_model_len):
            raise HostError(
                f"hosts of one replica sized their KV caches differently: host 0 has "
                f"{lead.num_total_blocks} blocks and max_model_len {lead.max_model_len}, host "
                f"{info.host_index} has {info.num_total_blocks} and {info.max_model_len}; they "
                f"must agree on one size (agree_on_kv_cache, or the same num_kv_blocks "
                f"everywhere) before the first step")
