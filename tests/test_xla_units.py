"""The XLA path's pieces that need no XLA devices: attention choice and formulations, head
splits, partition specs, mesh and backend errors. Runs in-process in a few seconds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from meshserve.config import ModelConfig, ParallelConfig
from meshserve.runner.attention import (PaddedAttention, PagedCpuAttention, PallasAttention,
                                        StepLayout, select_attention)
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.step import NewRequestData
from meshserve.runner.buckets import context_buckets, pick_bucket, reachable_request_buckets
from meshserve.runner.input_batch import InputBatch
from meshserve.runner.inputs import StepInputs
from meshserve.spmd.backend import Backend, create_backend
from meshserve.spmd.mesh import build_mesh
from meshserve.spmd.sharding import ShardingPlan, kv_head_copies, plan_sharding, weight_spec
from tests.paged_reference import mixed_step, reference_paged_attention

SMOLLM2 = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
    attention_bias=False, bos_token_id=1, eos_token_ids=(2,))


def backend(name: str, on_tpu: bool = False) -> Backend:
    return Backend(name, torch.device("cpu"), static_shapes=name == "xla", on_tpu=on_tpu)


def test_pallas_is_chosen_only_on_a_tpu() -> None:
    assert isinstance(select_attention(backend("xla", on_tpu=True), SMOLLM2, 8), PallasAttention)
    assert isinstance(select_attention(backend("xla"), SMOLLM2, 8), PaddedAttention)
    assert isinstance(select_attention(backend("cpu"), SMOLLM2, 8), PagedCpuAttention)


def test_tensor_parallel_sizes_must_split_whole_query_heads() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 .* valid sizes: 1, 3, 9"):
        kv_head_copies(SMOLLM2, 4)
    assert kv_head_copies(SMOLLM2, 3) == 1
    assert kv_head_copies(SMOLLM2, 9) == 3  # 3 KV heads over 9 shards: each repeated 3 times
    twelve = replace(SMOLLM2, num_attention_heads=12, num_key_value_heads=4)
    assert kv_head_copies(twelve, 6) == 3  # lcm(4, 6) = 12 heads, two per shard
    assert kv_head_copies(twelve, 2) == 1


def test_repeated_kv_heads_keep_each_query_head_on_its_own_kv_head() -> None:
    config = replace(SMOLLM2, num_attention_heads=4, num_key_value_heads=2, head_dim=3,
                     hidden_size=5, attention_bias=True)
    k = torch.arange(2 * 3 * 5, dtype=torch.float32).view(6, 5)
    b = torch.arange(6, dtype=torch.float32)
    plan = ShardingPlan(None, replace(config, num_key_value_heads=4), kv_copies=2)
    out = plan.weights({"model.layers.0.self_attn.k_proj.weight": k,
                        "model.layers.0.self_attn.k_proj.bias": b})
    heads = out["model.layers.0.self_attn.k_proj.weight"].view(4, 3, 5)
    # Query head i reads KV head i // 1 of the repeated model and i // 2 of the original.
    for i in range(4):
        assert torch.equal(heads[i], k.view(2, 3, 5)[i // 2])
    assert out["model.layers.0.self_attn.k_proj.bias"].tolist() == [0, 1, 2, 0, 1, 2,
                                                                     3, 4, 5, 3, 4, 5]
    assert plan_sharding(config, None).kv_copies == 1


@pytest.mark.parametrize("name, spec", [
    ("model.embed_tokens.weight", ("model", None)),
    ("lm_head.weight", ("model", None)),
    ("model.layers.3.self_attn.q_proj.weight", ("model", None)),
    ("model.layers.3.self_attn.k_proj.bias", ("model",)),
    ("model.layers.3.self_attn.v_proj.weight", ("model", None)),
    ("model.layers.3.self_attn.o_proj.weight", (None, "model")),
    ("model.layers.3.mlp.gate_proj.weight", ("model", None)),
    ("model.layers.3.mlp.up_proj.weight", ("model", None)),
    ("model.layers.3.mlp.down_proj.weight", (None, "model")),
    ("model.layers.3.input_layernorm.weight", (None,)),
    ("model.norm.weight", (None,)),
])
def test_megatron_partition_specs(name: str, spec: tuple) -> None:
    assert weight_spec(name, len(spec)) == spec


def test_warm_up_skips_request_buckets_no_step_can_fill() -> None:
    requests = [8, 16, 32, 64]
    assert reachable_request_buckets(requests, 16) == [8, 16]  # 9..16 requests in 16 tokens
    assert reachable_request_buckets(requests, 17) == [8, 16, 32]
    assert reachable_request_buckets(requests, 4) == [8]
    assert reachable_request_buckets(requests, 1024) == requests


def test_mesh_and_backend_errors() -> None:
    assert build_mesh(ParallelConfig(), num_devices=8) is None
    with pytest.raises(ValueError, match="2 x 1 = 2, but the XLA runtime has 8 devices"):
        build_mesh(ParallelConfig(tensor_parallel_size=2), num_devices=8)
    with pytest.raises(ValueError, match="needs device='xla'"):
        create_backend("cpu", ParallelConfig(tensor_parallel_size=2))


# ---------------------------------------------------------------------------------- attention
BLOCK, BLOCKS, HEADS, KV_HEADS, DIM = 4, 32, 4, 2, 16


def random_step(seed: int = 0) -> tuple[StepLayout, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor]:
    """A mixed step (two prefill chunks, two decodes) over a randomly filled paged cache."""
    return mixed_step([5, 1, 3, 1], [9, 7, 3, 12], block=BLOCK, blocks=BLOCKS, heads=HEADS,
                      kv_heads=KV_HEADS, dim=DIM, dtype=torch.float32, seed=seed)


def on_cpu(array: np.ndarray, token_major: bool) -> torch.Tensor:
    return torch.from_numpy(array)


@pytest.mark.parametrize("window", [None, 4])
def test_padded_attention_equals_the_reference(window: int | None) -> None:
    layout, q, k, v, k_hist, v_hist = random_step()
    want, want_k, want_v = reference_paged_attention(q, k, v, k_hist, v_hist, layout, 0.25,
                                                     window)
    padded = PaddedAttention(window)
    got, (got_k, got_v) = padded.forward(q, k, v, (k_hist, v_hist),
                                         padded.metadata(layout, on_cpu), 0.25)
    n = layout.num_tokens
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-5)
    # The updated cache comes back as new tensors (block 0, the null block, takes padding).
    torch.testing.assert_close(got_k[1:], want_k[1:], rtol=0, atol=0)
    torch.testing.assert_close(got_v[1:], want_v[1:], rtol=0, atol=0)


def test_padded_attention_on_a_block_table_cut_to_its_context_bucket() -> None:
    """The forward reads only a bucket's width of each block table; the keys past the
    longest request are never read, so the cut changes nothing."""
    assert context_buckets(32) == [4, 16, 32] and context_buckets(64) == [4, 16, 64]
    assert context_buckets(3) == [3]
    assert PagedCpuAttention(None).context_buckets(32) == [32]  # whole rows: no graph to fit
    layout, q, k, v, k_hist, v_hist = random_step()
    want, _, _ = reference_paged_attention(q, k, v, k_hist, v_hist, layout, 0.25, None)
    # As wide as the persistent batch's rows of a 64-token model (16 blocks of 4), then cut.
    wide = replace(layout, block_table=np.pad(layout.block_table, ((0, 0), (0, 12))))
    padded = PaddedAttention(None)
    width = pick_bucket(padded.context_buckets(wide.context_blocks),
                        -(-int(layout.seq_lens.max()) // BLOCK))
    assert width == 4 < wide.context_blocks
    cut = replace(wide, block_table=wide.block_table[:, :width])
    n = layout.num_tokens
    for table in (wide, cut):
        got, _ = padded.forward(q, k, v, (k_hist, v_hist), padded.metadata(table, on_cpu), 0.25)
        torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-5)


def static_inputs(requests: dict[str, tuple[int, SamplingParams]]) -> StepInputs:
    """A compiling backend's input preparation over a batch of requests (id: prompt length,
    params), each holding the blocks its prompt needs and all but its last token computed."""
    batch = InputBatch(max_reqs=8, max_model_len=256, max_blocks_per_req=256 // 16)
    next_block = 1
    for request_id, (length, params) in requests.items():
        blocks = tuple(range(next_block, next_block + -(-length // 16)))
        next_block += len(blocks)
        batch.add(NewRequestData(request_id, tuple(range(length)), length, params, 0, blocks,
                                 length - 1))
    return StepInputs(batch, block_size=16, max_model_len=256, vocab_size=100,
                      token_buckets=[16, 32, 64], request_buckets=[8], context_buckets=[4, 16],
                      static_shapes=True, seed=0)


def test_a_compiling_backend_picks_its_sampler_graph_and_context_bucket() -> None:
    greedy = SamplingParams(temperature=0.0)
    inputs = static_inputs({"a": (20, greedy), "b": (9, greedy)})
    step = inputs.prepare({"a": 1, "b": 1})
    assert step.layout.context_blocks == 4  # 20 tokens: 2 blocks, in the 4-block bucket
    assert step.sampling.all_greedy and step.sampling.penalties is None  # the argmax alone
    assert "greedy=True" in step.fingerprint()["program"]
    # A long request moves the step to the wide bucket; a penalty, even on a greedy row, or one
    # sampled row takes the general sampler, which always carries penalty columns.
    for requests in ({"a": (100, greedy)}, {"a": (9, SamplingParams(temperature=0.0,
                                                                     repetition_penalty=1.2))},
                     {"a": (9, greedy), "b": (9, SamplingParams(temperature=0.7))}):
        step = static_inputs(requests).prepare(dict.fromkeys(requests, 1))
        long = max(n for n, _ in requests.values()) > 64
        assert step.layout.context_blocks == (16 if long else 4)
        general = any(p.needs_penalties or p.temperature > 0 for _, p in requests.values())
        assert step.sampling.all_greedy is not general
        assert (step.sampling.penalties is not None) is general


def test_pallas_layout_and_metadata_against_torch_xlas_reference_loop() -> None:
    """The kernel's inputs (interleaved KV heads, padded head_dim, int32 request arrays) checked
    through torch_xla's own non-kernel reference, which runs on the CPU."""
    layout, q, k, v, k_hist, v_hist = random_step()
    want, _, _ = reference_paged_attention(q, k, v, k_hist, v_hist, layout, 0.25, None)
    pallas = PallasAttention(None, max_num_seqs=8, use_kernel=False)
    (shape,) = pallas.cache_shapes(BLOCKS, BLOCK, KV_HEADS, DIM)
    assert shape == (BLOCKS, BLOCK, 2 * KV_HEADS, 128)
    cache = torch.zeros(shape)
    cache[:, :, 0::2, :DIM], cache[:, :, 1::2, :DIM] = k_hist, v_hist
    got, _ = pallas.forward(q, k, v, (cache,), pallas.metadata(layout, on_cpu), 0.25)
    n = layout.num_tokens  # the reference loop returns the real tokens only
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-5)


def test_general_sampling_path_picks_the_flag_free_tokens() -> None:
    """What a compiling backend runs (every filter, penalties) changes nothing at neutral values,
    so seeded tokens do not depend on the backend or on what else shares the batch."""
    from meshserve.runner.sampler import PenaltyTensors, SamplingTensors, sample

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 500
    logits = torch.randn(rows, vocab, generator=gen) * 3
    plain = SamplingTensors(
        temperature=torch.full((rows,), 0.8), top_k=torch.zeros(rows, dtype=torch.long),
        top_p=torch.ones(rows), min_p=torch.zeros(rows), uniform=torch.rand(rows, generator=gen),
        all_greedy=False, use_top_k=False, use_top_p=False, use_min_p=False)
    ids = torch.randint(0, vocab + 1, (rows, 7), generator=gen)
    neutral = PenaltyTensors(torch.zeros(rows), torch.zeros(rows), torch.ones(rows), ids, ids)
    general = replace(plain, use_top_k=True, use_top_p=True, use_min_p=True, penalties=neutral)
    assert torch.equal(sample(logits, plain, 0).token_ids, sample(logits, general, 0).token_ids)
