"""``SequenceText``: one generated sequence as the text edge sees it, fed a ``TokenDelta`` at a
time.

The offline ``LLM`` and the HTTP ingress both receive token ids from engines and owe their users
text. This is the one place that turns the stream of deltas into tokens, logprobs, text and a finish
reason, including a stop string found in the text, which the engine cannot see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from meshserve.contracts.sampling import FinishReason, SamplingParams
from meshserve.contracts.tokens import TokenDelta, TokenLogprobs
from meshserve.text.detokenizer import IncrementalDetokenizer, Tokenizer

S = TypeVar("S", bound="SequenceText")


@dataclass
class SequenceText:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked for
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def start(cls: type[S], tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
              params: SamplingParams, /, **fields: Any) -> S:
        """A sequence about to be generated after ``prompt_token_ids``; ``fields`` are those a
        subclass adds (positional-only parameters above leave every field name free)."""
        return cls(IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params), **fields)

    @property
    def stopped(self) -> bool:
        """A stop string ended the sequence here, at the edge: its host may still be generating
        it, and whoever owns the request must abort it there."""
        return self.detokenizer.stopped

    @property
    def stop_reason(self) -> int | str | None:
        """What ended the sequence, as vLLM reports it: the stop string or the stop token id;
        None for an eos, its length, or while it runs (read on every delta: that answer first)."""
        if self.finish_reason != FinishReason.STOP.value:
            return None
        if self.stopped:
            return self.detokenizer.stop_string
        last = self.token_ids[-1]  # "stop" from the engine: its last token ended it
        return last if last in self.detokenizer.params.stop_token_ids else None

    def apply(self, delta: TokenDelta) -> str:
        """Take the sequence's next delta; return the text it releases (possibly empty)."""
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        self.num_cached_tokens = delta.num_cached_tokens
        # The engine reports "stop" only for a sequence whose last token is an eos or a stop id.
        released = self.detokenizer.add(list(delta.token_ids), delta.finish_reason is not None,
                                        stop_token=delta.finish_reason == FinishReason.STOP.value)
        self.text += released
        # A stop string wins over whatever the engine says ended this step, as in vLLM.
        self.finish_reason = FinishReason.STOP.value if self.stopped else delta.finish_reason
        return released
