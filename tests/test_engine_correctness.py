"""Greedy fp32 tokens and logprobs equal transformers' on the same weights, whatever the
batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from meshserve import LLM, SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def mixed_prompts(count: int, seed: int = 0, max_len: int = 200) -> list[list[int]]:
    """Prompts of lengths spread over 1..max_len, from ordinary (non-special) token ids."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(1, max_len, count).astype(int)
    rng.shuffle(lengths)
    return [rng.integers(100, 40000, size=n).tolist() for n in lengths]


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir: str):
    prompts = mixed_prompts(16)
    model = hf_model(tiny_llama_dir)
    eos = tuple(np.atleast_1d(model.generation_config.eos_token_id).tolist())
    return prompts, hf_greedy(model, prompts, GREEDY.max_tokens, eos), model


@pytest.mark.parametrize("builder", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir"])
def test_greedy_matches_transformers_on_mixed_batch(builder: str, request) -> None:
    path = request.getfixturevalue(builder)
    prompts = mixed_prompts(16, seed=1)
    model = hf_model(path)
    eos = tuple(np.atleast_1d(model.generation_config.eos_token_id).tolist())
    expected = hf_greedy(model, prompts, GREEDY.max_tokens, eos)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=512)
    assert tokens_of(llm.generate(prompts, GREEDY)) == expected


def test_chunked_prefill_with_32_token_budget(tiny_llama_dir: str, llama_reference) -> None:
    prompts, expected, _ = llama_reference
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", max_num_batched_tokens=32,
              num_kv_blocks=512)
    assert tokens_of(llm.generate(prompts, GREEDY)) == expected
    # One sequence alone: a step per 32-token prompt chunk, the last chunk sampling the first
    # token, then a step per further token.
    before = llm.engine.stats()
    [one] = llm.generate([list(range(100, 170))], SamplingParams(max_tokens=4, ignore_eos=True))
    after = llm.engine.stats()
    assert len(one.outputs[0].token_ids) == 4
    assert after.num_steps - before.num_steps == 3 + 3  # chunks 32 + 32 + 6, then 3 decodes
    assert after.execute_seconds > before.execute_seconds
    # The stepping thread's wait for a core is a part of those seconds.
    waited = after.cpu_wait_seconds - before.cpu_wait_seconds
    assert 0.0 <= waited <= after.execute_seconds - before.execute_seconds


def test_preemption_when_blocks_run_out(tiny_llama_dir: str, llama_reference) -> None:
    prompts, expected, _ = llama_reference
    # Room for about two of the longest requests (200 + 24 tokens = 14 blocks each).
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=30,
              max_model_len=256, enable_prefix_caching=False)
    assert tokens_of(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_shared_prefixes(tiny_llama_dir: str, llama_reference, prefix_caching: bool) -> None:
    _, _, model = llama_reference
    eos = tuple(np.atleast_1d(model.generation_config.eos_token_id).tolist())
    rng = np.random.default_rng(7)
    system = rng.integers(100, 40000, size=70).tolist()  # four full blocks and a bit
    prompts = [system + rng.integers(100, 40000, size=n).tolist() for n in (3, 17, 40, 1)]
    expected = hf_greedy(model, prompts, GREEDY.max_tokens, eos)
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=256,
              enable_prefix_caching=prefix_caching)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert tokens_of(first) == expected
    assert tokens_of(second) == expected
    hits = [o.num_cached_tokens for o in second]
    if prefix_caching:
        assert all(h >= 64 for h in hits), hits
        assert llm.engine.stats().prefix_cache_hit_tokens > 0
    else:
        assert hits == [0, 0, 0, 0]


def test_logprobs_equal_transformers_log_softmax(tiny_llama_dir: str, llama_reference) -> None:
    prompts, expected, model = llama_reference
    prompts, expected = prompts[:4], expected[:4]
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=5))
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + step]
            top_vals, top_ids = row.topk(5)
            assert entries[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert set(top_ids.tolist()) <= set(entries)
            for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
                assert entries[tid].logprob == pytest.approx(val, abs=1e-4)


def test_prompt_logprobs_equal_transformers_log_softmax(tiny_llama_dir: str,
                                                       llama_reference) -> None:
    """Every prompt token's logprob (and the top 4 at its position), with prompts prefilled in
    32-token chunks and sharing a prefix the cache must not serve (their logits are needed)."""
    prompts, _, model = llama_reference
    shared = prompts[5][:40]
    batch = [prompts[0], shared + [11, 12, 13], shared + [21, 22], [7]]
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=256,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4))
    for prompt, out in zip(batch, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for position in range(1, len(prompt)):
            entries, row = out.prompt_logprobs[position], ref[position - 1]
            token = prompt[position]
            assert entries[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            top_vals, top_ids = row.topk(4)
            for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
                assert entries[tid].logprob == pytest.approx(val, abs=1e-4)
    assert all(o.num_cached_tokens == 0 for o in outs)
    plain = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=2))
    assert all(o.prompt_logprobs is None for o in plain)


def test_bundled_smollm2_matches_transformers(hf_default_model) -> None:
    llm = LLM(None, dtype="float32", device="cpu", num_kv_blocks=256)
    tok = llm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",
             "Write a haiku about the sea.", "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    eos = llm.engine.eos_token_ids
    expected = hf_greedy(hf_default_model, prompts, 20, eos)
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=20))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert tokens_of(outs) == expected
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].text == tok.decode(expected[0], skip_special_tokens=True)
