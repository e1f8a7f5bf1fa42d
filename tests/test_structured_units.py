"""Structured output, piece by piece: the constraint contract, grammar parsing, the device mask,
the per-request grammar state and the scheduler's wait for a compiling grammar."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from meshserve.config import SchedulerConfig
from meshserve.contracts.sampling import FinishReason, SamplingParams
from meshserve.contracts.step import GrammarBitmask, RunnerOutput, bitmask_words
from meshserve.contracts.structured import StructuredOutputError, StructuredOutputParams
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.request import Request
from meshserve.engine.scheduler import Scheduler
from meshserve.runner.grammar_mask import apply_grammar_bitmask
from meshserve.structured import build_grammar
from meshserve.structured.manager import StructuredOutputManager, packed_mask
from meshserve.structured.state import GrammarState

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


# --- the contract ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": "abc"}, "structured_outputs.choice"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"grammar": "   "}, "structured_outputs.grammar"),
    ({"json_object": True, "disable_any_whitespace": "yes"},
     "structured_outputs.disable_any_whitespace"),
])
def test_malformed_constraints_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputParams(**kwargs)
    assert info.value.param == field
    assert str(info.value).startswith(f"{field}: ")


def test_constraint_normalises_to_hashable_plain_data() -> None:
    from_dict = StructuredOutputParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert from_dict.json == '{"type": "object", "properties": {"b": {}, "a": {}}}'  # order kept
    assert from_dict.kind == "json" and from_dict.field == "structured_outputs.json"
    choice = StructuredOutputParams(choice=["x", "y"])
    assert choice.choice == ("x", "y") and hash(choice) == hash(StructuredOutputParams(
        choice=("x", "y")))
    assert StructuredOutputParams(json=SCHEMA).key == StructuredOutputParams(
        json=json.dumps(SCHEMA)).key
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})


@pytest.mark.parametrize("kwargs, field, words", [
    ({"regex": "(ab"}, "structured_outputs.regex", "regular expression"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar", "grammar"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar", "grammar"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
     "structured_outputs.json", "JSON schema"),
    ({"structural_tag": {"type": "no-such-tag"}}, "structured_outputs.structural_tag",
     "structural tag"),
])
def test_invalid_grammars_are_refused_naming_the_field(kwargs: dict, field: str,
                                                       words: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        build_grammar(StructuredOutputParams(**kwargs))
    assert info.value.param == field and words in info.value.message


def test_every_constraint_kind_parses() -> None:
    for kwargs in ({"json": SCHEMA}, {"json_object": True}, {"regex": "[a-z]+"},
                   {"choice": ['say "hi"', "back\\slash", "naïve\n"]},
                   {"grammar": 'root ::= "yes" | "no"'}, {"grammar": 'start: "yes" | "no"'}):
        build_grammar(StructuredOutputParams(**kwargs))


# --- the device mask ------------------------------------------------------------------------

def test_grammar_mask_keeps_exactly_the_allowed_tokens_of_constrained_rows() -> None:
    rows, vocab = 5, 100  # 100 is not a multiple of 32: the last word is partly padding
    gen = np.random.default_rng(0)
    allowed = gen.random((rows, vocab)) < 0.3
    bits = np.zeros((rows, bitmask_words(vocab) * 32), dtype=np.uint8)
    bits[:, :vocab] = allowed
    bits[:, vocab:] = 1  # padding bits set: they must not leak into the result
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    constrained = np.array([True, False, True, True, False])
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    out = apply_grammar_bitmask(logits, torch.from_numpy(packed), torch.from_numpy(constrained))
    for r in range(rows):
        if constrained[r]:
            expected = torch.where(torch.from_numpy(allowed[r]), logits[r], float("-inf"))
            assert torch.equal(out[r], expected)
        else:
            assert torch.equal(out[r], logits[r])  # bit for bit
    # An eager runner may pass the constrained rows alone.
    only = torch.from_numpy(np.flatnonzero(constrained))
    assert torch.equal(apply_grammar_bitmask(logits[only], torch.from_numpy(packed)[only]),
                       out[only])


def test_bitmask_rows_follow_the_samplers_row_order() -> None:
    mask_a, mask_b = packed_mask([1, 40], 64), packed_mask([63], 64)
    grammar = GrammarBitmask(("a", "b"), np.stack([mask_a, mask_b]))
    bitmask, constrained = grammar.rows(["x", "b", None, "a"], 6)
    assert bitmask.shape == (6, 2) and bitmask.dtype == np.int32
    assert constrained.tolist() == [False, True, False, True, False, False]
    assert (bitmask[[0, 2, 4, 5]] == -1).all()
    assert np.array_equal(bitmask[1], mask_b) and np.array_equal(bitmask[3], mask_a)
    allowed = np.unpackbits(mask_a.view(np.uint8), bitorder="little")
    assert np.flatnonzero(allowed).tolist() == [1, 40]


# --- one request's grammar ------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    from tests.tiny_models import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    return StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def _state(manager: StructuredOutputManager, **constraint) -> GrammarState:
    state = manager.start(SamplingParams(structured_outputs=StructuredOutputParams(**constraint)))
    state.compiled.result(timeout=60)
    assert state.ready
    return state


def _allowed(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()


def _feed(manager, state: GrammarState, text: str) -> None:
    tokenizer = manager._tokenizer
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert token in _allowed(state.next_mask)
        state.accept(token)


def test_a_completed_grammar_allows_only_the_stop_token(manager) -> None:
    eos = manager.stop_token_ids[0]
    state = _state(manager, choice=["yes", "no"])
    _feed(manager, state, "yes")
    assert _allowed(state.next_mask) == [eos] and state.finish_reason is None
    state.accept(eos)
    assert state.finish_reason is FinishReason.STOP  # e.g. with ignore_eos, the grammar ends it


def test_a_grammar_with_nowhere_to_go_ends_the_request(manager) -> None:
    eos = manager.stop_token_ids[0]
    # The stop token is no way out: the grammar only ends by itself at a dead end.
    state = GrammarState(Future(), packed_mask([eos], manager.vocab_size))
    state.compiled.set_exception(RuntimeError("compilation failed"))
    assert state.ready  # it failed: the request may run, and only a stop token is allowed
    assert _allowed(state.next_mask) == [eos]
    state.accept(eos)
    assert state.finish_reason is FinishReason.GRAMMAR


def test_a_rejected_token_ends_the_request_with_reason_grammar(manager) -> None:
    state = _state(manager, regex="[0-9]+")
    letter = manager._tokenizer.encode("x", add_special_tokens=False)[0]
    state.accept(letter)
    assert state.finish_reason is FinishReason.GRAMMAR


def test_identical_constraints_compile_once(manager) -> None:
    params = StructuredOutputParams(regex="[a-c]{3}")
    first = manager.compiler.submit(params)
    assert manager.compiler.submit(StructuredOutputParams(regex="[a-c]{3}")) is first
    with pytest.raises(StructuredOutputError, match="structured_outputs.regex"):
        manager.compiler.submit(StructuredOutputParams(regex="[a-"))


def test_accept_advances_only_the_constrained_requests_that_sampled(manager) -> None:
    constrained = Request("c", [1, 2], SamplingParams(), grammar=_state(manager, regex="[0-9]"))
    free = Request("f", [1, 2], SamplingParams())
    digit = manager._tokenizer.encode("7", add_special_tokens=False)[0]
    manager.accept(RunnerOutput({"c": digit, "f": digit}), {"c": constrained, "f": free})
    assert _allowed(constrained.grammar.next_mask) == list(manager.stop_token_ids)
    assert constrained.append_token(digit, 100) is False  # the grammar is complete, not ended


# --- the scheduler waits for grammars, not for each other ------------------------------------

class _Compiling:
    """A grammar state whose compilation finishes when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    @property
    def ready(self) -> bool:
        return self.done.is_set()


def test_a_compiling_grammar_lets_later_requests_run_first() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64), BlockManager(32, 4, False))
    grammar = _Compiling()
    scheduler.add_request(Request("slow", [1, 2, 3], SamplingParams(), grammar=grammar))
    scheduler.add_request(Request("free", [4, 5, 6], SamplingParams()))
    first = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"free"}
    grammar.done.set()
    assert set(scheduler.schedule().num_scheduled_tokens) == {"slow", "free"}
