"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, shaped after vLLM's."""

from __future__ import annotations

import itertools
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from meshserve.config import EngineConfig
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.tokens import TokenLogprobs
from meshserve.engine.engine import EngineCore
from meshserve.text.sequence import SequenceText

logger = logging.getLogger("meshserve.llm")

PromptType = str | list[str] | list[int] | list[list[int]]


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # One dict per generated token: token id -> Logprob, holding the sampled token and the top k.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    # The stop string or stop token id that ended it (None for an eos or any other end).
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(step[tok].logprob for step, tok in zip(self.logprobs, self.token_ids))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    # With SamplingParams(prompt_logprobs=k): one dict per prompt token (None for the first),
    # holding the token itself and the k most likely tokens at its position, as in vLLM.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    """Generate from a batch of prompts on one local engine.

    ``model=None`` serves the bundled SmolLM2-135M-Instruct. Every other engine setting is a
    keyword named as in ``meshserve.config`` (and as the CLI's flags): ``device`` is ``"cpu"``
    (eager torch), ``"xla"`` (torch_xla) or ``"auto"``; ``tensor_parallel_size`` /
    ``data_parallel_size`` shape the device mesh on xla; ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``num_kv_blocks``, ``max_model_len`` and
    ``enable_prefix_caching`` size the scheduler and the KV cache as in vLLM. An unknown keyword
    raises ``ValueError`` naming it.
    """

    def __init__(self, model: str | None = None, **engine_settings: Any) -> None:
        config = EngineConfig.from_flat({"model": model, **engine_settings})
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no params: the model's generation defaults
        (see the ``generation_config`` setting), else SamplingParams' own, as in vLLM."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: PromptType, sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``."""
        params = sampling_params or self.get_default_sampling_params()
        token_lists, texts = self._tokenize(prompts)
        for tokens in token_lists:  # validate everything before queueing anything
            self.engine.prompt_limits.check(tokens)
        outputs: list[RequestOutput] = []
        states: dict[str, tuple[RequestOutput, SequenceText]] = {}
        for tokens, text in zip(token_lists, texts):
            base = str(next(self._ids))
            out = RequestOutput(base, text, list(tokens), [])
            outputs.append(out)
            for index in range(params.n):
                request_id = f"{base}-{index}"
                states[request_id] = (out, SequenceText.start(self.tokenizer, tokens, params))
                self.engine.add_request(request_id, list(tokens), params, sample_index=index)
        start, done = time.perf_counter(), 0
        while self.engine.has_unfinished:
            for delta in self.engine.step():
                out, sequence = states[delta.request_id]
                sequence.apply(delta)
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None and out.prompt_logprobs is None:
                    out.prompt_logprobs = [None] + [
                        self._logprob_dict(token, lp) for token, lp in
                        zip(out.prompt_token_ids[1:], delta.prompt_logprobs)]
                if sequence.stopped:  # a stop string: the engine is still generating it
                    self.engine.abort(delta.request_id)
                if sequence.finish_reason is not None:
                    done += 1
                    if use_tqdm:
                        print(f"\rgenerated {done}/{len(states)} in "
                              f"{time.perf_counter() - start:.1f}s", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        for out, sequence in states.values():  # in insertion order: sample 0, 1, ... per prompt
            out.outputs.append(self._completion(len(out.outputs), sequence, params))
        for out in outputs:
            out.finished = True
        return outputs

    def _completion(self, index: int, sequence: SequenceText,
                    params: SamplingParams) -> CompletionOutput:
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._logprob_dict(t, lp)
                        for t, lp in zip(sequence.token_ids, sequence.logprobs)]
        return CompletionOutput(index, sequence.text, sequence.token_ids, logprobs,
                                sequence.finish_reason, sequence.stop_reason)

    def _logprob_dict(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        sampled, top_ids, top_lps = lp
        entries = {t: Logprob(v, rank + 1, self.tokenizer.decode([t]))
                   for rank, (t, v) in enumerate(zip(top_ids, top_lps))}
        if token not in entries:
            rank = 1 + sum(v > sampled for v in top_lps)
            entries[token] = Logprob(sampled, rank, self.tokenizer.decode([token]))
        return entries

    def _tokenize(self, prompts: PromptType) -> tuple[list[list[int]], list[str | None]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: expected a str, a non-empty list of str, or token-id lists")
        if all(isinstance(t, int) for t in prompts):
            prompts = [prompts]  # a single token-id list
        token_lists, texts = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                token_lists.append(self.tokenizer.encode(prompt, add_special_tokens=True))
                texts.append(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                token_lists.append(list(prompt))
                texts.append(None)
            else:
                raise ValueError("prompts: each prompt must be a str or a list of token ids")
        return token_lists, texts
