"""The lockstep guard of multi-host replicas: hosts compare what they are about to run before they
run it, and a host that stops answering fails its replica within the step deadline.

The fingerprint checks are plain data. The replica checks start a lead ``HostActor`` and one
``FollowerHost`` on a local two-node Ray cluster (every socket on 127.0.0.1) with the cpu backend
and a tiny model, then break the follower: it receives different inputs, or it is frozen with
SIGSTOP while requests run.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import ray

from meshserve.actors.host import HostActor
from meshserve.actors.lockstep import FollowerHost, Lockstep, differences, step_fingerprint
from meshserve.actors.messages import HostError
from meshserve.actors.placement import place_hosts
from meshserve.config import EngineConfig, ParallelConfig
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.step import (GrammarBitmask, NewRequestData, RunnerOutput,
                                      RunningRequestData, SchedulerOutput)
from tests.local_cluster import local_cluster

DEADLINE_S = 3.0
ENGINE = dict(device="cpu", block_size=16, num_kv_blocks=64, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, step_deadline_s=DEADLINE_S)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


def a_step(**changes) -> SchedulerOutput:
    new = NewRequestData("a", (1, 2, 3), 3, SamplingParams(temperature=0), 0, (1,), 0)
    step = SchedulerOutput((new,), (RunningRequestData("b", (4,), 20),), {"a": 3, "b": 1},
                           frozenset({"c"}))
    return replace(step, **changes)


# --- Plain data --------------------------------------------------------------------------------


def test_equal_steps_have_equal_fingerprints() -> None:
    assert differences(step_fingerprint(a_step()), step_fingerprint(a_step())) == []


@pytest.mark.parametrize("changes, part", [
    (dict(new_requests=(NewRequestData("a", (1, 2, 4), 3, SamplingParams(temperature=0), 0,
                                       (1,), 0),)), "step requests"),
    (dict(running_requests=(RunningRequestData("b", (5,), 20),)), "step blocks"),
    (dict(num_scheduled_tokens={"a": 2, "b": 1}), "step tokens"),
    (dict(finished_request_ids=frozenset()), "step finished"),
    (dict(grammar=GrammarBitmask(("a",), np.zeros((1, 2), np.int32))), "step grammar"),
])
def test_a_difference_is_named_by_its_part(changes: dict, part: str) -> None:
    (difference,) = differences(step_fingerprint(a_step()), step_fingerprint(a_step(**changes)))
    assert difference.startswith(f"{part}: ") and "where the lead has" in difference


# --- A two-host replica --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(workers=2) as cluster:
        yield cluster


class ShiftedInputsFollower(FollowerHost):
    """Test-only: from its third step on, this host sees one prompt token changed."""

    steps = 0

    def prepare(self, number, step):
        self.steps += 1
        if self.steps >= 3 and step.new_requests:
            first = step.new_requests[0]
            shifted = replace(first, token_ids=(first.token_ids[0] + 1,) + first.token_ids[1:])
            step = replace(step, new_requests=(shifted,) + step.new_requests[1:])
        return super().prepare(number, step)


class LeadWithLessMemory(HostActor):
    """Test-only: a lead host whose device reports ``LEAD_FREE`` bytes free."""

    def __init__(self, *args, **kwargs) -> None:
        pretend_free_memory(LEAD_FREE)
        super().__init__(*args, **kwargs)


class FollowerWithLessMemory(FollowerHost):
    """Test-only: a follower host whose device reports ``FOLLOWER_FREE`` bytes free."""

    def __init__(self, *args, **kwargs) -> None:
        pretend_free_memory(FOLLOWER_FREE)
        super().__init__(*args, **kwargs)


LEAD_FREE, FOLLOWER_FREE = 2 << 20, 1 << 20
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # K and V x 2 layers x 16 slots x 2 KV heads x 16 x fp32


def pretend_free_memory(free: int) -> None:
    """What this host's backend measures (its own process only): less than the machine has."""
    from meshserve.spmd.backend import Backend

    Backend.free_memory = lambda self: free


@pytest.fixture
def replica(cluster, tiny_llama_dir, request):
    lead_class, follower_class, engine = getattr(request, "param", (HostActor, FollowerHost, {}))
    config = EngineConfig.from_flat({"model": tiny_llama_dir, **ENGINE, **engine})
    placement = place_hosts(num_replicas=1, hosts_per_replica=2, host_num_cpus=1)
    lead_slot, follower_slot = placement.replicas[0]
    follower = ray.remote(follower_class).options(**follower_slot.actor_options()).remote(
        config, host_index=1)
    lead = ray.remote(lead_class).options(**lead_slot.actor_options()).remote(
        config, followers=[follower])
    # The lead answers once the hosts have agreed on and allocated the cache; the follower after.
    infos = [ray.get(lead.info.remote(), timeout=180)]
    infos.append(ray.get(follower.info.remote(), timeout=180))
    yield lead, follower, infos
    for actor in (lead, follower):
        ray.kill(actor)
    placement.release()


def stream_all(lead, prompts: list[list[int]], params: SamplingParams) -> list:
    return [lead.generate_stream.options(num_returns="streaming").remote(p, params)
            for p in prompts]


def drain(stream, timeout: float) -> None:
    for ref in stream:
        ray.get(ref, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("replica", [(HostActor, ShiftedInputsFollower, {})],
                         indirect=True)
def test_a_follower_with_other_inputs_fails_the_replica_before_it_runs(replica) -> None:
    lead, _, _ = replica
    # One request at a time, so the third step admits a new request whose prompt is shifted.
    ray.get(lead.generate.remote([5, 6, 7], SamplingParams(temperature=0, max_tokens=1)),
            timeout=60)
    ray.get(lead.generate.remote([8, 9], SamplingParams(temperature=0, max_tokens=1)),
            timeout=60)
    start = time.monotonic()
    with pytest.raises(HostError, match=r"host 1 would run a different step 3 than the lead; "
                                        r"the replica is out of step: .*step requests: 1 new.*"
                                        r"; tokens: [0-9a-f]+ where the lead has [0-9a-f]+$"):
        ray.get(lead.generate.remote([10, 11, 12], LONG), timeout=60)
    assert time.monotonic() - start < DEADLINE_S  # refused at once, not by the deadline
    with pytest.raises(HostError, match="out of step"):  # and it takes no more work
        ray.get(lead.generate.remote([1, 2], LONG), timeout=60)


class OtherBucketsFollower(FollowerHost):
    """Test-only: this host's runner pads every step to its buckets, where the lead's (cpu)
    runs the exact sizes: the same inputs, another compiled program."""

    def allocate(self, num_blocks: int) -> None:
        super().allocate(num_blocks)  # the runner lays steps out once its cache exists
        self.engine.runner.inputs.static_shapes = True


@pytest.mark.slow
@pytest.mark.parametrize("replica", [(HostActor, OtherBucketsFollower, {})],
                         indirect=True)
def test_a_follower_that_picks_another_bucket_fails_the_replica_before_it_runs(replica) -> None:
    lead, _, _ = replica
    with pytest.raises(HostError, match=r"host 1 would run a different step 1 than the lead; "
                                        r"the replica is out of step: .*program: tokens=16 rows=8 "
                                        r".* where the lead has tokens=3 rows="):
        ray.get(lead.generate.remote([5, 6, 7], LONG), timeout=60)


@pytest.mark.slow
def test_a_frozen_follower_ends_every_stream_within_the_deadline(replica) -> None:
    lead, follower, (_, follower_info) = replica
    streams = stream_all(lead, [[3 + i, 4, 5, 6] for i in range(4)], LONG)
    ray.get(next(streams[0]), timeout=60)  # generation is under way
    os.kill(follower_info.pid, signal.SIGSTOP)
    try:
        frozen = time.monotonic()
        for stream in streams:
            with pytest.raises(HostError, match=rf"host 1 did not answer step \d+ within "
                                                rf"{DEADLINE_S:g}s \(step_deadline_s\)"):
                drain(stream, timeout=DEADLINE_S + 30)
        assert time.monotonic() - frozen < DEADLINE_S + 5
    finally:
        os.kill(follower_info.pid, signal.SIGCONT)


class StuckEngine:
    """Test-only: an engine whose runner's run of a step never returns until released."""

    def __init__(self, deadline: float) -> None:
        self.config = EngineConfig(parallel=ParallelConfig(step_deadline_s=deadline))
        self.release = threading.Event()
        self.runner = self

    def prepare(self, step: SchedulerOutput) -> StuckEngine:
        return self

    def fingerprint(self) -> dict[str, str]:
        return {"program": "stuck"}

    def run(self, prepared: StuckEngine) -> RunnerOutput:
        self.release.wait(timeout=60)
        return RunnerOutput({})


def test_a_step_stuck_in_the_lead_is_reported_once_past_the_deadline() -> None:
    engine, lockstep = StuckEngine(deadline=1.0), Lockstep([])
    thread = threading.Thread(target=lockstep.execute, args=(engine, a_step()), daemon=True)
    thread.start()
    try:
        assert lockstep.stall() is None  # within the deadline: a slow step, not a stuck one
        deadline = time.monotonic() + 10
        while lockstep.stall() is None:
            assert time.monotonic() < deadline, "the stuck step was never reported"
            time.sleep(0.05)
        assert re.fullmatch(r"host 0 has been running step 1 for \d+s, past the 1s step "
                            r"deadline; the replica is stuck", lockstep.stall())
    finally:
        engine.release.set()
        thread.join(timeout=10)
    assert lockstep.stall() is None and lockstep.num_steps == 1


@pytest.mark.slow
@pytest.mark.parametrize("replica", [(LeadWithLessMemory, FollowerWithLessMemory, {
    "num_kv_blocks": None, "memory_fraction": 0.1, "dtype": "float32", "max_model_len": 128})],
    indirect=True)
def test_hosts_with_different_free_memory_allocate_the_smallest_cache(replica) -> None:
    lead, follower, (lead_info, follower_info) = replica
    smallest = int(FOLLOWER_FREE * 0.1 // BYTES_PER_BLOCK)  # the follower's figure
    assert int(LEAD_FREE * 0.1 // BYTES_PER_BLOCK) > smallest  # the lead alone would take more
    # Every host allocated the smallest figure (HostInfo leaves the padding block out).
    assert lead_info.num_total_blocks == follower_info.num_total_blocks == smallest - 1
    # The agreed cache serves: a prompt that needs most of it runs on both hosts in step.
    tokens = ray.get(lead.generate.remote(list(range(7, 107)), SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True)), timeout=120).token_ids
    assert len(tokens) == 20
