"""The device-free parts: buckets, block manager, scheduler, persistent batch, sampler rules."""

from __future__ import annotations

import pytest
import torch

from meshserve.config import SchedulerConfig
from meshserve.contracts import NewRequestData, RunnerOutput, SamplingParams
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.request import Request
from meshserve.engine.scheduler import Scheduler
from meshserve.runner.buckets import pick_bucket, request_buckets, token_buckets
from meshserve.runner.input_batch import InputBatch
from meshserve.runner.sampler import SamplingTensors, greedy_tokens, sample


def test_buckets() -> None:
    assert token_buckets(100) == [16, 32, 64, 128]
    assert token_buckets(600, gap=128) == [16, 32, 64, 128, 256, 384, 512, 640]
    assert request_buckets(40) == [8, 16, 32, 40]
    assert pick_bucket([16, 32, 64], 17) == 32
    with pytest.raises(ValueError):
        pick_bucket([16, 32], 33)


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens,
                                                              temperature=0))


def test_prefix_cache_shares_blocks_and_evicts_lru() -> None:
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    a = req("a", 10)
    assert bm.find_cached_prefix(a) == []
    assert len(bm.allocate(a, 10)) == 3
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = req("b", 10)
    hit = bm.find_cached_prefix(b)
    assert hit == bm.block_ids("a")[:2]  # two full blocks shared
    b.num_computed_tokens = 8
    bm.allocate(b, 2, hit)
    assert bm.blocks[hit[0]].ref_count == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks == 8
    # Still cached after free, until allocation pressure evicts them.
    c = req("c", 10)
    assert len(bm.find_cached_prefix(c)) == 2
    big = Request("big", list(range(100, 132)), SamplingParams())
    assert len(bm.allocate(big, 32)) == 8
    assert bm.find_cached_prefix(c) == []


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    r = req("r", 12)
    assert bm.allocate(r, 12) is None
    assert bm.num_free_blocks == 2 and bm.block_ids("r") == []


def run(scheduler: Scheduler, token: int = 7, max_steps: int = 200) -> list:
    steps = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return steps
        step = scheduler.schedule()
        steps.append(step)
        done = {rid for rid, n in step.num_scheduled_tokens.items()
                if scheduler.requests[rid].num_computed_tokens + n
                == scheduler.requests[rid].num_tokens}
        scheduler.update(step, RunnerOutput({rid: token for rid in done}))
    raise AssertionError("did not finish")


def test_budget_chunks_prefill_and_caps_sequences() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64), bm)
    for i in range(3):
        s.add_request(req(f"r{i}", 10))
    steps = run(s)
    assert all(step.total_num_scheduled_tokens <= 8 for step in steps)
    assert all(len(step.num_scheduled_tokens) <= 2 for step in steps)
    assert steps[0].num_scheduled_tokens == {"r0": 8}
    assert steps[1].num_scheduled_tokens == {"r0": 2, "r1": 6}
    assert bm.num_free_blocks == bm.num_total_blocks


def test_preemption_recomputes_and_finishes_everyone() -> None:
    bm = BlockManager(7, 4, enable_prefix_caching=False)  # 6 usable blocks
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    requests = [req(f"r{i}", 7, max_tokens=8) for i in range(3)]
    for r in requests:
        s.add_request(r)
    steps = run(s)
    assert s.num_preemptions > 0
    assert any(step.finished_request_ids for step in steps)
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_abort_waiting_and_running() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), bm)
    s.add_request(req("run", 5))
    s.add_request(req("wait", 5))
    s.schedule()
    s.abort("run")
    s.abort("wait")
    assert not s.has_unfinished
    assert s.schedule().finished_request_ids == {"run", "wait"}
    assert bm.num_free_blocks == bm.num_total_blocks


def test_input_batch_condense_keeps_rows_dense() -> None:
    batch = InputBatch(max_reqs=8, max_model_len=32, max_blocks_per_req=8)
    for i in range(5):
        batch.add(NewRequestData(f"r{i}", tuple(range(i + 1)), i + 1, SamplingParams(), 0,
                                 (i + 1,), 0))
    batch.remove("r1")
    batch.remove("r3")
    batch.condense()
    assert batch.num_reqs == 3
    assert sorted(batch.req_ids[:3]) == ["r0", "r2", "r4"]
    row = batch.index["r4"]
    assert row < 3 and batch.num_tokens[row] == 5 and batch.block_table[row, 0] == 5
    assert list(batch.token_ids[row, :5]) == [0, 1, 2, 3, 4]


def test_input_batch_rows_do_not_depend_on_the_order_requests_finish_in() -> None:
    """Hosts of one replica get a step's finished requests as a set, iterated in a different
    order in each process; a request admitted in the same step must land in the same row."""
    layouts = []
    for finished in (["r1", "r3"], ["r3", "r1"]):
        batch = InputBatch(max_reqs=8, max_model_len=32, max_blocks_per_req=8)
        for i in range(5):
            batch.add(NewRequestData(f"r{i}", (i,), 1, SamplingParams(), 0, (i + 1,), 0))
        for request_id in finished:
            batch.remove(request_id)
        batch.add(NewRequestData("new", (9,), 1, SamplingParams(), 0, (9,), 0))
        batch.condense()
        layouts.append(batch.req_ids[:batch.num_reqs])
    assert layouts[0] == layouts[1] == ["r0", "new", "r2", "r4"]


def tensors(rows: int, **overrides) -> SamplingTensors:
    base = dict(temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.long),
                top_p=torch.ones(rows), min_p=torch.zeros(rows),
                uniform=torch.linspace(0, 0.999, rows), all_greedy=False, use_top_k=False,
                use_top_p=False, use_min_p=False)
    base.update(overrides)
    return SamplingTensors(**base)


def test_sampler_filters_respect_their_limits() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 64))
    top_k = sample(logits, tensors(64, top_k=torch.full((64,), 2), use_top_k=True), 0).token_ids
    assert set(top_k.tolist()) == {0, 1}
    top_p = sample(logits, tensors(64, top_p=torch.full((64,), 0.7), use_top_p=True), 0).token_ids
    assert set(top_p.tolist()) == {0, 1}
    min_p = sample(logits, tensors(64, min_p=torch.full((64,), 0.5), use_min_p=True), 0).token_ids
    assert set(min_p.tolist()) == {0, 1}
    free = sample(logits, tensors(64), 0).token_ids
    assert set(free.tolist()) == {0, 1, 2, 3}
    greedy = sample(logits, tensors(64, temperature=torch.zeros(64)), 3)
    assert set(greedy.token_ids.tolist()) == {0}
    assert torch.allclose(greedy.sampled_logprobs, torch.log(torch.tensor(0.5)))


def test_greedy_picks_the_first_of_equal_maxima_as_torch_does() -> None:
    torch.manual_seed(0)
    logits = torch.randn(32, 49152)
    logits[3, [7, 9000, 40000]] = 50.0  # ties: the first wins, as in transformers' argmax
    logits[5] = 0.0
    logits[6, 11] = float("-inf")
    expected = logits.max(dim=-1).indices
    assert expected[3] == 7 and expected[5] == 0
    greedy = greedy_tokens(logits)
    assert greedy.dtype == torch.int64 and torch.equal(greedy, expected)
    # A non-contiguous view (a row selection) reads the same rows.
    assert torch.equal(greedy_tokens(logits[::2]), expected[::2])
