"""The text edge: incremental detokenization (one decode step per token) and stop strings, checked
against whole-text decoding on the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest

from meshserve.contracts.sampling import SamplingParams
from meshserve.text import detokenizer
from meshserve.text.detokenizer import IncrementalDetokenizer
from tests.tiny_models import smollm2_tokenizer

TEXT = "naïve café — 東京 🙂 Hello, world! The quick brown fox jumps over 12 lazy dogs.\n"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _cases(tok, count: int):
    """(context, tokens, skip_special_tokens): random ids (byte-fallback pieces included),
    real text cut anywhere, and special tokens sprinkled in."""
    rng = random.Random(0)
    text_ids = tok.encode(TEXT * 3, add_special_tokens=False)
    special = sorted(tok.all_special_ids)
    for i in range(count):
        context = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 8))]
        if i % 3 == 0:
            start = rng.randrange(len(text_ids) - 40)
            tokens = text_ids[start:start + rng.randint(1, 40)]
        else:
            tokens = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        if i % 4 == 0:
            tokens = [rng.choice(special) if rng.random() < 0.2 else t for t in tokens]
        yield context, tokens, i % 2 == 0


def test_the_stream_decoder_gives_the_window_decoders_text_token_by_token(tok) -> None:
    used_stream = 0
    for context, tokens, skip in _cases(tok, 400):
        chosen = detokenizer._decoder(tok, context, skip)
        used_stream += isinstance(chosen, detokenizer._StreamDecoder)
        window = detokenizer._WindowDecoder(tok, context, skip)
        expected = [window.step(t) for t in tokens] + [window.flush()]
        got = [chosen.step(t) for t in tokens] + [chosen.flush()]
        assert "".join(got) == "".join(expected), (context, tokens, skip)
        # Nothing is released early: every prefix of the output is a prefix of the final text.
        assert all("".join(got[:k]) == "".join(expected)[:len("".join(got[:k]))]
                   for k in range(len(got)))
    assert used_stream > 300  # the fast path is the common one


def test_text_equals_decoding_the_whole_sequence(tok) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("x"), SamplingParams())
    pieces = [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_a_prompt_cut_inside_a_character_takes_the_window_path(tok) -> None:
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1  # byte-level pieces
    chosen = detokenizer._decoder(tok, emoji[:1], skip_special=True)
    assert isinstance(chosen, detokenizer._WindowDecoder)


def test_decode_side_clean_up_keeps_the_window_path(tok, monkeypatch) -> None:
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True, raising=False)
    assert isinstance(detokenizer._decoder(tok, [], True), detokenizer._WindowDecoder)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_are_found_across_token_boundaries_and_never_leak(tok, include) -> None:
    ids = tok.encode(TEXT * 2, add_special_tokens=False)
    full = tok.decode(ids)
    rng = random.Random(1)
    for _ in range(60):
        at = rng.randrange(1, len(full) - 8)
        stop = full[at:at + rng.randint(1, 6)]
        if not stop.strip():
            continue
        decoy = "zzz-never"  # a second stop string that never occurs
        params = SamplingParams(stop=[decoy, stop], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, tok.encode("x"), params)
        released = ""
        for i, token in enumerate(ids):
            released += detok.add([token], finished=i == len(ids) - 1)
            if detok.stopped:
                break
        first = full.index(stop)
        want = full[:first + len(stop)] if include else full[:first]
        assert detok.stopped and released == detok.text == want, (stop, released[-20:])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_leaves_its_text_out_unless_asked(tok, include) -> None:
    # The eos with skip_special_tokens off: the one case where a stop token has text to show.
    ids = tok.encode("The river runs past the old mill.") + [tok.eos_token_id]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, tok.encode("x"), params)
    text = detok.add(ids[:-3], finished=False)
    text += detok.add(ids[-3:], finished=True, stop_token=True)
    assert text == detok.text == tok.decode(ids if include else ids[:-1])
    assert text.endswith(tok.eos_token) == include
