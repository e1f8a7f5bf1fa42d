"""The cpu backend's compiled step: inductor programs built at warm-up, dispatched without dynamo.

Tokens against transformers are checked in test_engine_correctness.py (the compiled step is the
default there); this module checks what the compilation itself promises: the same tokens as the
eager step, nothing compiled or traced after warm-up whatever the traffic, and a dispatch that
never consults dynamo.
"""

from __future__ import annotations

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.runner.compiled import CompiledPiece
from meshserve.spmd.backend import cpu_flags, create_backend
from tests.test_engine_correctness import mixed_prompts
from tests.workload import compile_counters, run_random_workload

ENGINE = dict(dtype="float32", device="cpu", max_num_seqs=16, max_num_batched_tokens=64,
              max_model_len=256)


@pytest.fixture(scope="module")
def compiled_and_eager(tiny_llama_dir: str) -> tuple[LLM, LLM]:
    return (LLM(tiny_llama_dir, num_kv_blocks=400, **ENGINE),
            LLM(tiny_llama_dir, num_kv_blocks=400, enforce_eager=True, **ENGINE))


def test_compiled_and_eager_agree_token_for_token(compiled_and_eager) -> None:
    compiled, eager = compiled_and_eager
    prompts = mixed_prompts(12, seed=4)
    for params in (SamplingParams(temperature=0, max_tokens=24),
                   SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=24,
                                  logprobs=3)):
        a, b = compiled.generate(prompts, params), eager.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # forward, logits and the grammar mask, once each
    assert compiled.engine.runner.warm_up_report.programs == 3
    assert eager.engine.runner.warm_up_report.programs == 0


def test_the_compiled_forward_holds_its_weights_frozen_in(compiled_and_eager) -> None:
    # Freezing makes the weights constants of the program, which is what lets inductor prepack
    # each linear layer's weight once (oneDNN/MKL) instead of transposing it at every call. The
    # sign of it: the program holds its own copy of the linear weights, so zeroing the module's
    # changes nothing it computes.
    compiled, _ = compiled_and_eager
    model = compiled.engine.runner.model
    prompts = mixed_prompts(4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
    # An embedding is read by index, in place; a head tied to it shares that weight.
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    weights = [m.weight for m in model.modules()
               if isinstance(m, torch.nn.Linear) and id(m.weight) not in embedded]
    assert weights
    saved = [w.detach().clone() for w in weights]
    try:
        with torch.no_grad():
            for w in weights:
                w.zero_()
        assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params)] == want
    finally:
        with torch.no_grad():
            for w, s in zip(weights, saved):
                w.copy_(s)


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_a_batch_of_one_or_two_sequences_warms_up_and_agrees(tiny_llama_dir: str,
                                                               max_num_seqs: int) -> None:
    settings = {**ENGINE, "max_num_seqs": max_num_seqs}
    compiled = LLM(tiny_llama_dir, num_kv_blocks=64, **settings)
    eager = LLM(tiny_llama_dir, num_kv_blocks=64, enforce_eager=True, **settings)
    prompts = mixed_prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = compile_counters()
    ours = compiled.generate(prompts, params)
    assert compile_counters() == before
    assert ([o.outputs[0].token_ids for o in ours]
            == [o.outputs[0].token_ids for o in eager.generate(prompts, params)])


def test_random_workload_after_warm_up_compiles_nothing(tiny_llama_dir: str) -> None:
    # Few KV blocks (preemption) and a 64-token budget (chunked prefill).
    llm = LLM(tiny_llama_dir, num_kv_blocks=40, **ENGINE)
    before = compile_counters()
    report = run_random_workload(llm.engine, seed=3)
    assert report["preemptions"] > 0 and report["steps"] > 30
    assert compile_counters() == before


def test_dispatch_skips_dynamo_and_refuses_a_program_that_is_not_general() -> None:
    def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x * scale).sum(dim=0)

    piece = CompiledPiece(scaled, backend="eager", dynamic=True, eager=False)
    piece.warm_up(None, torch.ones(3, 2), 2.0)
    piece.warm_up(None, torch.ones(5, 2), 2.0)  # the same program covers another size
    before = compile_counters()
    assert torch.equal(piece(None, torch.ones(7, 2), 2.0), torch.full((2,), 14.0))
    assert compile_counters() == before  # no frame converted, no guard failed, nothing traced

    bad = CompiledPiece(scaled, backend="eager", dynamic=True, eager=False)
    bad.warm_up(None, torch.ones(3, 2), 2.0)
    with pytest.raises(RuntimeError, match="a dynamic piece must compile once"):
        bad.warm_up(None, torch.ones(3, 2), 3.0)  # a new constant needs a second program


def test_bf16_linears_are_inductors_amx_gemms_exactly_where_the_cpu_has_tiles() -> None:
    # The decode speed of bf16 rests on this choice; a torch upgrade or a refused permission must
    # not drop it unnoticed, and no other dtype or CPU may take it.
    backend = create_backend("cpu")
    amx = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    assert backend.compile_options(torch.bfloat16) == (
        amx if {"amx_tile", "amx_bf16"} <= cpu_flags() else {"freezing": True})
    assert backend.compile_options(torch.float32) == {"freezing": True}
    assert backend.generates_gemms(torch.bfloat16) == ({"amx_tile", "amx_bf16"} <= cpu_flags())
    assert not backend.generates_gemms(torch.float32)


def test_a_sequence_computes_the_same_bits_alone_and_in_a_batch(tiny_llama_dir: str) -> None:
    # In the dtype this CPU serves (bf16 through inductor's AMX GEMMs where it has them, SiLU and
    # multiply in the up projection's epilogue), a row's arithmetic must not depend on the rows
    # beside it or on a cached prefix, or a streamed request and its non-streamed twin could part
    # at a near-tie.
    llm = LLM(tiny_llama_dir, dtype="auto", device="cpu", max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=400)
    runner = llm.engine.runner
    mlp = runner.model.model.layers[0].mlp
    # gate and up stay two GEMMs exactly where the GEMMs are generated (so the epilogue can fuse)
    assert (mlp.gate_up_proj is None) == runner.backend.generates_gemms(runner.dtype)
    prompt, *others = mixed_prompts(8, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    (alone,) = llm.generate([prompt], params)
    batched = llm.generate([*others[:4], prompt, *others[4:]], params)[4]
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    assert batched.outputs[0].logprobs == alone.outputs[0].logprobs
