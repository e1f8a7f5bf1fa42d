"""Prompt checks against a model's limits: one set of rules and messages for every entry point.

``EngineCore`` checks each prompt before it queues it (so ``LLM`` and the host actors refuse bad
prompts with the same words), and the HTTP ingress checks with the limits a host reported, so a bad
request is answered 400 before it is routed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PromptError(ValueError):
    """A prompt, or the ``max_tokens`` that goes with it, breaks a limit of the model."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param  # the request field at fault: "prompt" or "max_tokens"


@dataclass(frozen=True, slots=True)
class PromptLimits:
    max_model_len: int  # prompt and generated tokens together
    vocab_size: int

    def check(self, token_ids: Sequence[int]) -> None:
        """Raise ``PromptError`` unless ``token_ids`` is a prompt this model can continue."""
        if len(token_ids) == 0:
            raise PromptError("prompt", "must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptError("prompt", f"{len(token_ids)} tokens leave no room to generate "
                                        f"within this model's context "
                                        f"(max_model_len={self.max_model_len})")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise PromptError("prompt", f"token ids must be integers in [0, {self.vocab_size})")

    def max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """What a request may generate after its prompt: ``requested`` if it fits, or (None) all
        the room the prompt leaves."""
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise PromptError("max_tokens", f"{requested} plus the prompt's {num_prompt_tokens} "
                                            f"tokens exceeds this model's context "
                                            f"(max_model_len={self.max_model_len})")
        return requested
