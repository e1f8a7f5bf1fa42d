"""Incremental detokenization and stop strings: the text edge of a request.

Decoding token by token would split multi-byte characters and lose the leading spaces that
SentencePiece/BPE tokenizers attach to words. Two decoders give the same text:

- ``_StreamDecoder``: tokenizers' ``DecodeStream`` (Rust), one step per token, for fast tokenizers
  whose ``decode`` adds no Python-side clean-up. It holds a token back while the text it ends in is
  an incomplete character.
- ``_WindowDecoder``: any tokenizer with ``decode``: each token decodes a short window twice (with
  and without it) and emits the difference, holding text back while it ends in U+FFFD.

At the end of a sequence whatever is still held (even an incomplete character) is released, as
the window decoder always did, so both decoders return the same text.
"""

from __future__ import annotations

from typing import Protocol

from meshserve.contracts.sampling import SamplingParams

_WINDOW = 6  # tokens of context before the unread ones; enough for any merge we have seen


class Tokenizer(Protocol):
    """What detokenization needs of a tokenizer; transformers' tokenizers have it."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class _WindowDecoder:
    def __init__(self, tokenizer: Tokenizer, context: list[int], skip_special: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.tokens = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special)

    def step(self, token: int) -> str:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])[len(before):]
        self.read_offset = len(self.tokens)
        return text


class _StreamDecoder:
    def __init__(self, tokenizer, context: list[int], skip_special: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.skip_special = skip_special
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special)
        self.emitted = list(context)[-_WINDOW:]  # the last tokens whose text is out
        self.held: list[int] = []  # tokens the stream holds back (an incomplete character)

    def step(self, token: int) -> str:
        text = self.stream.step(self.backend, token)
        if text is None:
            self.held.append(token)
            return ""
        self.emitted = (self.emitted + self.held + [token])[-_WINDOW:]
        self.held = []
        return text

    def flush(self) -> str:
        if not self.held:
            return ""
        decode = self.tokenizer.decode
        before = decode(self.emitted, skip_special_tokens=self.skip_special)
        text = decode(self.emitted + self.held, skip_special_tokens=self.skip_special)
        self.held = []
        return text[len(before):]


def _decoder(tokenizer: Tokenizer, context: list[int], skip_special: bool):
    # DecodeStream reproduces `decode` only where `decode` is the Rust decoder alone (transformers'
    # clean-up of spaces before punctuation happens in Python, after it), and only after a context
    # that ends on a whole character (a prompt cut inside one would be re-emitted with the text).
    if (getattr(tokenizer, "backend_tokenizer", None) is not None
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
            and not tokenizer.decode(context, skip_special_tokens=skip_special).endswith("\ufffd")):
        return _StreamDecoder(tokenizer, context, skip_special)
    return _WindowDecoder(tokenizer, context, skip_special)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.params = params
        self._decoder = _decoder(tokenizer, list(prompt_token_ids[-_WINDOW:]),
                                 params.skip_special_tokens)
        self.text = ""
        self.stopped = False  # a stop string was found: the request must be aborted
        self.stop_string: str | None = None  # the one found first, once stopped
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        # Stop strings can straddle steps: keep this much text unreleased.
        self._hold = max(self._longest_stop - 1, 0)
        self._released = 0
        self._searched = 0  # how much of the text the last stop-string search covered

    def add(self, token_ids: list[int], finished: bool, stop_token: bool = False) -> str:
        """Feed new tokens; return the text that may be shown now (may be empty). ``stop_token``:
        the last of them ended the sequence (an eos or a stop token id), so its text is left out
        unless ``include_stop_str_in_output``, as vLLM leaves it out."""
        if stop_token and not self.params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        step = self._decoder.step
        pieces = [step(token) for token in token_ids]
        if finished:
            pieces.append(self._decoder.flush())  # whatever is left is final now
        self.text += "".join(pieces)
        self._check_stop()
        end = len(self.text) if finished or self.stopped else max(
            self._released, len(self.text) - self._hold)
        delta = self.text[self._released:end]
        self._released = end
        return delta

    def _check_stop(self) -> None:
        if not self._longest_stop or self.stopped:
            return
        # Only text new since the last search can complete a match; one may start up to
        # (longest stop - 1) characters before it.
        search_from = max(0, self._searched - (self._longest_stop - 1))
        self._searched = len(self.text)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[:at + len(stop)] if self.params.include_stop_str_in_output \
                else self.text[:at]
            self.stopped, self.stop_string = True, stop
