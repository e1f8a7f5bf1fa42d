"""Sampling, validation, stop conditions and block accounting of the offline engine."""

from __future__ import annotations

import pytest

from meshserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=256,
               max_model_len=512)


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_total_blocks


PROMPTS = [[101, 2002, 303, 404], [555, 666], list(range(1000, 1040))]


def test_token_budget_defaults_to_the_cpu_devices(llm: LLM) -> None:
    # Unset, max_num_batched_tokens is the device's default (2048 on cpu), for the scheduler
    # and the runner's buckets alike.
    assert llm.engine.config.scheduler.max_num_batched_tokens is None
    assert llm.engine.scheduler.config.max_num_batched_tokens == 2048
    assert llm.engine.runner.max_num_batched_tokens == 2048


def test_seeded_sampling_reproduces_and_seeds_differ(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    # Same seed, different company in the batch: same tokens.
    crowd = llm.generate(PROMPTS, params)[0].outputs[0].token_ids
    assert first == crowd
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16,
                           ignore_eos=True)
    assert llm.generate(PROMPTS[:1], other)[0].outputs[0].token_ids != first


def test_seed_survives_chunked_prefill(tiny_llama_dir: str, llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS[2:], params)[0].outputs[0].token_ids
    chunked = LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                  max_num_batched_tokens=16, max_model_len=512)
    assert chunked.generate(PROMPTS[2:], params)[0].outputs[0].token_ids == expected


def test_n_samples_and_max_tokens(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True)
    out = llm.generate(PROMPTS[:1], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all_blocks_free(llm)


def test_stop_token_ids_and_ignore_eos(llm: LLM) -> None:
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10,
                                                    ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[3]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10,
                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # The stop token's text is left out unless include_stop_str_in_output, as in vLLM.
    kept = llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_at],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.token_ids == out.token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])
    assert kept.text == llm.tokenizer.decode(kept.token_ids) != out.text
    assert free.text.startswith(kept.text)


def test_stop_string_truncates_text_and_frees_blocks(llm: LLM) -> None:
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16,
                                                    ignore_eos=True))[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    assert stop.strip(), free.text
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16,
                                                   stop=[stop]))[0].outputs[0]
    assert out.text == free.text[:free.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert free.stop_reason is None  # ended by its length
    assert all_blocks_free(llm)


def test_presence_and_frequency_penalties_stop_repeats(llm: LLM) -> None:
    prompt = [[7, 7, 7, 7, 7, 7, 7, 7]]
    penalised = llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0,
        presence_penalty=2.0))[0].outputs[0].token_ids
    # The tiny model's logits span far less than 2, so a penalised token never wins again.
    assert len(set(penalised)) == len(penalised)


def test_penalties_match_transformers_and_openai_rules() -> None:
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from meshserve.runner.sampler import PenaltyTensors, apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    prompt = torch.tensor([[1, 2, 3], [4, 4, 50]])  # 50 = padding (vocab size)
    output = torch.tensor([[5, 5, 9], [6, 50, 50]])
    ones = torch.ones(2)
    rep_only = apply_penalties(logits, PenaltyTensors(0 * ones, 0 * ones, 1.7 * ones, output,
                                                      prompt))
    seen = torch.tensor([[1, 2, 3, 5, 5, 9], [4, 4, 6, 6, 6, 6]])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(seen, logits.clone())
    assert torch.allclose(rep_only, expected)
    openai = apply_penalties(logits, PenaltyTensors(0.5 * ones, 0.25 * ones, ones, output,
                                                    prompt))
    by_hand = logits.clone()
    by_hand[0, 5] -= 0.5 + 2 * 0.25
    by_hand[0, 9] -= 0.5 + 0.25
    by_hand[1, 6] -= 0.5 + 0.25
    assert torch.allclose(openai, by_hand)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
])
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_engine_untouched(llm: LLM) -> None:
    ok = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = llm.generate(PROMPTS, ok)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([PROMPTS[0], []], ok)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPTS[0], [7] * 600], ok)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10**9]], ok)
    assert not llm.engine.has_unfinished
    assert all_blocks_free(llm)
    after = llm.generate(PROMPTS, ok)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_abort_frees_blocks_and_others_finish(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, params)
    engine.step()
    engine.step()
    assert engine.abort("abort-1")
    finished = {}
    while engine.has_unfinished:
        for delta in engine.step():
            if delta.finish_reason:
                finished[delta.request_id] = delta.finish_reason
    assert finished == {"abort-0": "length", "abort-2": "length"}
    assert all_blocks_free(llm)


def test_multibyte_text_is_never_split(llm: LLM) -> None:
    tok = llm.tokenizer
    text = "naïve café — 東京 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    from meshserve.text.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok, [tok.encode("x")[0]], SamplingParams())
    pieces = [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_sequence_text_ends_at_a_stop_string_found_at_the_edge(llm: LLM) -> None:
    from meshserve.contracts import TokenDelta
    from meshserve.deploy.choices import ChoiceState

    tok = llm.tokenizer
    prompt = tok.encode("x")
    params = SamplingParams(stop=["brown"], logprobs=0)
    choice = ChoiceState.start(tok, prompt, params, index=3, prompt_token_ids=prompt)
    released = ""
    for token in tok.encode(" the quick brown fox jumps", add_special_tokens=False):
        released += choice.apply(TokenDelta("r", (token,), ((-0.5, (), ()),), None, 1, 0))
        if choice.stopped:
            break
    assert choice.stopped and choice.finish_reason == "stop"
    assert released == choice.text == " the quick "
    assert len(choice.logprobs) == len(choice.token_ids) and choice.index == 3
