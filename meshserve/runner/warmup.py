"""Warm-up: compile every program a runner's pieces can be asked for, before serving starts.

On xla that is a finite set of static shapes: the forward per token bucket and context bucket
(block-table width: one unless the attention cuts the table, see ``PaddedAttention``), the
selection per (token bucket, reachable request bucket), the logits per request bucket, and
sampling per request bucket: greedy alone, general, or general with the rank filters, each with
logprobs on or off and grammar masks on or off. On cpu the forward, the logits and the grammar
mask are each compiled once for dynamic sizes, and proven general by a second call at unrelated
sizes.
Every call runs on padding (no request's tokens, writes into the null block), and each prints a
progress line, so a long compilation is visibly alive.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from meshserve.contracts.sampling import MAX_LOGPROBS
from meshserve.contracts.step import GrammarBitmask, bitmask_words
from meshserve.runner.attention import AttentionBackend, AttentionMetadata
from meshserve.runner.buckets import reachable_request_buckets
from meshserve.runner.compiled import CompiledPiece
from meshserve.runner.inputs import SamplingArrays, StepInputs
from meshserve.runner.sampler import SamplingTensors
from meshserve.spmd.backend import Backend

logger = logging.getLogger("meshserve.warmup")

# Dynamic warm-up sizes (tokens, sequences, sampled rows): two unrelated sets, none of them 0 or
# 1, and no two alike, so the compiled program cannot have specialised on any of them.
_DYNAMIC_SIZES = ((7, 3, 5), (13, 2, 11))


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    programs: int  # programs compiled: one per (piece, shape) on xla, one per piece on cpu
    new_graphs: int  # growth of torch_xla's compiled-graph count (0 on cpu)
    seconds: float


class Runner(Protocol):
    """What warm-up needs of a model runner: its pieces and how it builds their inputs."""

    backend: Backend
    attention: AttentionBackend
    inputs: StepInputs
    enforce_eager: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    forward: CompiledPiece
    select: CompiledPiece
    logits: CompiledPiece
    sample: CompiledPiece
    prompt_logprobs: CompiledPiece
    grammar_mask: CompiledPiece | None  # only where sample runs eagerly (dynamic shapes)

    def to_device(self, array: np.ndarray, token_major: bool = False) -> torch.Tensor: ...

    def forward_step(self, key: Hashable, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, *, warm_up: bool = False) -> torch.Tensor: ...

    def sampling_tensors(self, s: SamplingArrays) -> SamplingTensors: ...


class _Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        _say(f"warm-up {self.done}/{self.total}: {what} "
             f"({time.perf_counter() - self.start:.0f} s elapsed)")


def warm_up(runner: Runner) -> WarmUpReport:
    if runner.enforce_eager and not runner.backend.static_shapes:
        return WarmUpReport(0, 0, 0.0)  # eager torch: nothing to compile
    start, before = time.perf_counter(), runner.backend.num_compiled_graphs()
    if runner.backend.static_shapes:
        programs = _warm_up_static(runner)
    else:
        programs = _warm_up_dynamic(runner)
    report = WarmUpReport(programs, runner.backend.num_compiled_graphs() - before,
                          time.perf_counter() - start)
    _say(f"warm-up done: {report.programs} programs in {report.seconds:.1f} s")
    return report


def _say(message: str) -> None:
    logger.info(message)
    print(f"meshserve: {message}", file=sys.stderr, flush=True)


def _padding_inputs(runner: Runner, tokens: int, seqs: int, context: int | None = None):
    """A step's device inputs that carry no request: ``seqs`` empty sequences, ``tokens``
    padding tokens, a block table ``context`` blocks wide (the persistent batch's rows are only
    read, and are empty at warm-up)."""
    layout = runner.inputs.layout(np.zeros(seqs, dtype=np.int32), padded=tokens, context=context)
    meta = runner.attention.metadata(layout, runner.to_device)
    return runner.to_device(layout.input_ids, True), runner.to_device(layout.positions, True), meta


def _warm_up_dynamic(runner: Runner) -> int:
    progress = _Progress(3 * len(_DYNAMIC_SIZES))
    for tokens, seqs, rows in _DYNAMIC_SIZES:
        # The persistent batch has max_num_seqs rows. Below 3 every step's sequences are padded
        # to the same MIN_SIZE anyway, so a program specialised on it is the general one.
        seqs = min(seqs, runner.max_num_seqs)
        progress(f"forward, {tokens} tokens over {seqs} sequences")
        hidden = runner.forward_step(None, *_padding_inputs(runner, tokens, seqs), warm_up=True)
        progress(f"logits, {rows} rows")
        logits = runner.logits.warm_up(None, hidden[:1].expand(rows, -1).contiguous())
        progress(f"grammar mask, {rows} rows")
        # Every token allowed: the program must not depend on which are.
        words = -(-logits.shape[1] // 32)
        runner.grammar_mask.warm_up(None, logits.float(),
                                    torch.full((rows, words), -1, dtype=torch.int32))
    return (runner.forward.num_programs + runner.logits.num_programs
            + runner.grammar_mask.num_programs)


def _warm_up_static(runner: Runner) -> int:
    inputs = runner.inputs
    pairs = [(t, r) for t in inputs.token_buckets
             for r in reachable_request_buckets(inputs.request_buckets,
                                                min(t, runner.max_num_batched_tokens))]
    rows = sorted({r for _, r in pairs})
    # Greedy alone, general, or general with the rank filters (inputs.py's three sampler
    # graphs); logprobs on or off; grammar masks on or off.
    samplers = list(itertools.product(((True, False), (False, False), (False, True)),
                                      (0, MAX_LOGPROBS), (False, True)))
    contexts = inputs.context_buckets
    progress = _Progress(len(inputs.token_buckets) * (1 + len(contexts)) + len(pairs)
                         + len(rows) * (1 + len(samplers)))
    # Every compile gets inputs that no earlier compile has taken: on a mesh, torch_xla 2.9's
    # dynamo bridge builds a wrong program (garbage out, on every later call) from a tensor
    # that another compile already took. So each consumer of the forward's hidden states or of
    # the logits gets them fresh from the program compiled just before (a rerun is cheap).
    selected = {}
    for t in inputs.token_buckets:
        for c in contexts:
            progress(f"forward, {t} tokens" + (f", {c} blocks of context" if len(contexts) > 1
                                               else ""))
            padding, key = _padding_inputs(runner, t, 0, c), (t, c)
            runner.forward_step(key, *padding, warm_up=True)
        for r in (r for tt, r in pairs if tt == t):
            progress(f"last-token selection, {t} tokens x {r} requests")
            selected[r] = runner.select.warm_up((t, r), runner.forward_step(key, *padding),
                                                runner.to_device(np.zeros(r, dtype=np.int64)))
        progress(f"prompt logprobs, {t} tokens")
        index, next_ids = (runner.to_device(np.zeros(t, dtype=np.int64)) for _ in range(2))
        runner.prompt_logprobs.warm_up(t, runner.forward_step(key, *padding), index, next_ids,
                                       MAX_LOGPROBS)
    nothing = np.zeros(0, dtype=np.int64)
    for r in rows:
        progress(f"logits, {r} requests")
        runner.logits.warm_up(r, selected[r])
        greedy = inputs.sampling(nothing, nothing.astype(bool), r)  # padding rows: greedy
        general = replace(greedy, all_greedy=False, use_min_p=True,
                          penalties=inputs.penalties(nothing, r))
        free = GrammarBitmask((), np.zeros((0, bitmask_words(inputs.vocab_size)), np.int32))
        bitmask, constrained = free.rows([], r)  # every row free: padding
        for (all_greedy, ranked), k, masked in samplers:
            mode = ("greedy" if all_greedy else
                    f"{'with' if ranked else 'no'} top-k/top-p")
            progress(f"sampling, {r} requests, {mode}, {'with' if k else 'no'} logprobs, "
                     f"{'with' if masked else 'no'} grammar")
            variant = greedy if all_greedy else replace(general, use_top_k=ranked,
                                                        use_top_p=ranked)
            if masked:
                variant = replace(variant, grammar_bitmask=bitmask, grammar_rows=constrained)
            runner.sample.warm_up((r, all_greedy, ranked, k, masked),
                                  runner.logits(r, selected[r]),
                                  runner.sampling_tensors(variant), k)
    return progress.total  # one program (or lazily traced graph) per call
