"""Incremental detokenization and stop strings: the text edge of a request.

Decoding token by token would split multi-byte characters and lose the leading spaces that
SentencePiece/BPE tokenizers attach to words. So each step decodes a short window of tokens twice
(with and without the new ones) and emits the difference, holding text back while it ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Protocol

from meshserve.contracts.sampling import SamplingParams

_WINDOW = 6  # tokens of context before the unread ones; enough for any merge we have seen


class Tokenizer(Protocol):
    """What detokenization needs of a tokenizer; transformers' tokenizers have it."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.tokens = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stopped = False  # a stop string was found: the request must be aborted
        # Stop strings can straddle steps: keep this much text unreleased.
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._released = 0

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Feed new tokens; return the text that may be shown now (may be empty)."""
        for token in token_ids:
            self.tokens.append(token)
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            after = self._decode(self.tokens[self.prefix_offset:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
        if finished and self.read_offset < len(self.tokens):
            # Whatever is left (even an incomplete character) is final now.
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.tokens[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.tokens)
        self._check_stop()
        end = len(self.text) if finished or self.stopped else max(
            self._released, len(self.text) - self._hold)
        delta = self.text[self._released:end]
        self._released = end
        return delta

    def _check_stop(self) -> None:
        if not self.params.stop or self.stopped:
            return
        # Only the newly decoded tail can hold a new match.
        search_from = max(0, self._released - max(len(s) for s in self.params.stop))
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[:at + len(stop)] if self.params.include_stop_str_in_output \
                else self.text[:at]
            self.stopped = True
