"""A step's inputs, laid out on the CPU with numpy before anything touches the device.

``StepInputs`` turns the persistent batch and a ``SchedulerOutput`` into a ``PreparedStep``: token
ids, positions and slot mapping (padded to a token bucket on a compiling backend, to two tokens on
cpu), which rows are sampled and whether their token is real, the sampling parameters as columns,
and the dispatch keys of the pieces the step will run. It is plain numpy, so every host of a
replica can fingerprint what it is about to run and compare before the device does anything.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

from meshserve.contracts.sampling import MAX_LOGPROBS
from meshserve.contracts.step import GrammarBitmask
from meshserve.runner.attention import StepLayout
from meshserve.runner.attention.paged_cpu import MIN_SIZE
from meshserve.runner.buckets import pick_bucket
from meshserve.runner.input_batch import InputBatch
from meshserve.runner.sampler import PenaltyTensors, SamplingTensors

SamplingArrays = SamplingTensors[np.ndarray]  # the sampler's inputs before the device has them


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The prompt positions whose next token's logprobs a request asked for (prompt_logprobs):
    the hidden state of token ``index[i]`` scores prompt token ``next_ids[i]``; ``owners`` says
    whose they are, in order, as (request id, how many, top-k wanted)."""

    index: np.ndarray  # [N] int64, padded (padding rows read token 0, then drop)
    next_ids: np.ndarray  # [N] int64
    owners: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class PreparedStep:
    layout: StepLayout
    active: np.ndarray  # [A] batch rows with tokens this step
    completes: np.ndarray  # [A] bool: the row's known tokens are all computed, its sample is real
    logits_index: np.ndarray  # [R] int64 token whose hidden state each sampled row reads
    sampling: SamplingArrays
    num_logprobs: int  # top logprobs gathered per row (0: none)
    token_bucket: int  # tokens the forward runs (the padded count)
    prompt: PromptRows | None = None  # prompt logprobs to compute this step, if any

    @property
    def rows(self) -> int:
        """Rows the logits and the sampler run (a request bucket on a compiling backend)."""
        return len(self.logits_index)

    def fingerprint(self) -> dict[str, str]:
        """What this host is about to run, by part: equal on every host of a replica, or the
        replica is out of step."""
        layout, s = self.layout, self.sampling
        arrays = {
            "tokens": (layout.input_ids, layout.positions),
            "kv_writes": (layout.slot_mapping,),
            "attention": (layout.query_start_loc, layout.seq_lens, layout.block_table),
            "sampled_rows": (self.logits_index, self.completes),
            "sampling": (s.temperature, s.top_k, s.top_p, s.min_p, s.uniform),
        }
        if s.grammar_bitmask is not None:
            arrays["grammar"] = (s.grammar_bitmask, s.grammar_rows, s.grammar_index)
        if self.prompt is not None:
            arrays["prompt_logprobs"] = (self.prompt.index, self.prompt.next_ids)
        parts = {name: _digest(values) for name, values in arrays.items()}
        parts["program"] = (f"tokens={self.token_bucket} rows={self.rows} "
                            f"context={layout.context_blocks} greedy={s.all_greedy} "
                            f"ranked={s.use_top_k or s.use_top_p} logprobs={self.num_logprobs} "
                            f"penalties={s.penalties is not None} "
                            f"grammar={s.grammar_bitmask is not None}")
        return parts


def _digest(arrays: tuple[np.ndarray, ...]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        if a is not None:  # a part this backend does not use (grammar rows or index)
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class StepInputs:
    """Builds ``PreparedStep`` s for one runner: its batch, block size, buckets and RNG."""

    def __init__(self, batch: InputBatch, *, block_size: int, max_model_len: int,
                 vocab_size: int, token_buckets: list[int], request_buckets: list[int],
                 context_buckets: list[int], static_shapes: bool, seed: int) -> None:
        self.batch = batch
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_buckets = token_buckets
        self.request_buckets = request_buckets
        self.context_buckets = context_buckets  # block-table widths (attention's choice)
        self.static_shapes = static_shapes
        # Draws for unseeded requests; the same seed on every host keeps lockstep replicas equal.
        self.rng = np.random.default_rng(seed)

    def prepare(self, num_scheduled_tokens: dict[str, int],
                grammar: GrammarBitmask | None = None) -> PreparedStep:
        batch = self.batch
        scheduled = np.fromiter((num_scheduled_tokens.get(r, 0)
                                 for r in batch.req_ids[:batch.num_reqs]), dtype=np.int32,
                                count=batch.num_reqs)
        active = np.flatnonzero(scheduled)  # rows with work this step
        layout = self.layout(scheduled)
        computed = batch.num_computed_tokens[active] + scheduled[active]
        completes = computed == batch.num_tokens[active]  # the sampled token is real
        rows = len(active)
        rows = pick_bucket(self.request_buckets, rows) if self.static_shapes else max(rows,
                                                                                     MIN_SIZE)
        logits_index = np.zeros(rows, dtype=np.int64)  # padding rows read token 0, then drop
        logits_index[:len(active)] = layout.query_start_loc[1:][active] - 1
        sampling = self.sampling(active, completes, rows)
        if grammar is not None:
            sampled_ids = [batch.req_ids[r] if c else None for r, c in zip(active, completes)]
            bitmask, constrained = grammar.rows(sampled_ids, rows)
            if self.static_shapes:  # one masked program per request bucket: every row, flagged
                sampling = replace(sampling, grammar_bitmask=bitmask, grammar_rows=constrained)
            else:
                index = np.flatnonzero(constrained)
                sampling = replace(sampling, grammar_bitmask=bitmask[index], grammar_index=index)
        return PreparedStep(layout, active, completes, logits_index, sampling,
                            self.num_logprobs(active, completes), len(layout.input_ids),
                            self.prompt_rows(active, scheduled, layout))

    def prompt_rows(self, active: np.ndarray, scheduled: np.ndarray,
                    layout: StepLayout) -> PromptRows | None:
        """This step's positions p of requests with prompt_logprobs whose token p + 1 is still a
        prompt token; padded to the token bucket (two rows at least on cpu)."""
        batch = self.batch
        index, next_ids, owners = [], [], []
        for row in active:
            params = batch.params[row]
            if params.prompt_logprobs is None:
                continue
            start = int(batch.num_computed_tokens[row])
            end = min(start + int(scheduled[row]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            first = int(layout.query_start_loc[row])
            index.append(np.arange(first, first + end - start))
            next_ids.append(batch.token_ids[row, start + 1:end + 1].astype(np.int64))
            owners.append((batch.req_ids[row], end - start, params.prompt_logprobs))
        if not owners:
            return None
        count = sum(n for _, n, _ in owners)
        padded = len(layout.input_ids) if self.static_shapes else max(count, MIN_SIZE)
        return PromptRows(_padded(np.concatenate(index), padded, 0),
                          _padded(np.concatenate(next_ids), padded, 0), tuple(owners))

    # ------------------------------------------------------------------ tokens
    def layout(self, scheduled: np.ndarray, padded: int | None = None,
               context: int | None = None) -> StepLayout:
        """Token ids, positions and slot mapping of a step, padded to its token bucket, and the
        block table cut to the first context bucket that holds its longest request (``padded``
        and ``context`` force a bucket: warm-up)."""
        batch, bs = self.batch, self.block_size
        n, total = len(scheduled), int(scheduled.sum())
        if padded is None:
            padded = (pick_bucket(self.token_buckets, total) if self.static_shapes
                      else max(total, MIN_SIZE))
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(scheduled, out=starts[1:])
        rows = np.repeat(np.arange(n), scheduled)  # [total] owning row of each token
        positions = np.zeros(padded, dtype=np.int64)
        positions[:total] = batch.num_computed_tokens[rows] + np.arange(total) - starts[rows]
        pos = positions[:total]
        input_ids = np.zeros(padded, dtype=np.int64)
        input_ids[:total] = batch.token_ids[rows, pos]
        slots = np.zeros(padded, dtype=np.int64)  # padding writes into the null block
        slots[:total] = batch.block_table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (batch.num_computed_tokens[:n] + scheduled).astype(np.int64)
        if context is None:
            context = pick_bucket(self.context_buckets, -(-int(seq_lens.max(initial=0)) // bs))
        return StepLayout(input_ids, positions, slots, rows, starts, seq_lens,
                          batch.block_table[:n, :context])

    # ------------------------------------------------------------------ sampling
    def num_logprobs(self, active: np.ndarray, completes: np.ndarray) -> int:
        params = self.batch.params
        wanted = [params[r].logprobs for r, c in zip(active, completes) if c]
        wanted = [k for k in wanted if k is not None]
        if not wanted:
            return 0
        # A compiling backend always gathers the most any request may ask for, so k is not a
        # graph dimension; eager takes what this batch needs (even 0 needs the sampled logprob).
        return MAX_LOGPROBS if self.static_shapes else max(max(wanted), 1)

    def sampling(self, active: np.ndarray, completes: np.ndarray, rows: int) -> SamplingArrays:
        b, count = self.batch, len(active)
        temperature = np.zeros(rows, dtype=np.float32)
        temperature[:count] = np.where(completes, b.temperature[active], 0.0)
        uniform = np.zeros(rows, dtype=np.float32)
        for i in np.flatnonzero(temperature[:count] > 0):
            uniform[i] = self._uniform(int(active[i]))
        top_k = _padded(b.top_k[active].astype(np.int64), rows, 0)
        top_p = _padded(b.top_p[active], rows, 1.0)
        min_p = _padded(b.min_p[active], rows, 0.0)
        sampling = temperature > 0
        use_top_k = bool((top_k[sampling] > 0).any())
        use_top_p = bool((top_p[sampling] < 1).any())
        penalized = any(b.params[r].needs_penalties for r in active)
        if self.static_shapes:
            # A compiling backend has three sampler graphs per request bucket (times logprobs
            # and grammar on or off). A greedy batch with no penalty takes the argmax alone;
            # any other runs the general path (greedy rows, min-p and penalties included),
            # with the rank filters as one flag: they need a sort of the vocabulary (~55 ms per
            # step on XLA:CPU) that most batches can skip.
            all_greedy = not sampling.any() and not penalized
            use_min_p = not all_greedy
            use_top_k = use_top_p = use_top_k or use_top_p
            penalties = None if all_greedy else self.penalties(active, rows)
        else:
            all_greedy, use_min_p = not sampling.any(), bool((min_p[sampling] > 0).any())
            penalties = self.penalties(active, rows) if penalized else None
        return SamplingTensors(temperature, top_k, top_p, min_p, uniform, all_greedy, use_top_k,
                               use_top_p, use_min_p, penalties)

    def _uniform(self, row: int) -> float:
        seed = self.batch.params[row].seed
        if seed is None:
            return float(self.rng.random())
        # Keyed by (seed, sample, token index): independent of batch, chunking and preemption.
        index = int(self.batch.num_tokens[row] - self.batch.num_prompt_tokens[row])
        sample = int(self.batch.sample_index[row])
        return float(np.random.default_rng([seed, sample, index]).random())

    def penalties(self, active: np.ndarray, rows: int) -> PenaltyTensors[np.ndarray]:
        """The penalty columns of rows ``active``, padded to ``rows`` (neutral in padding)."""
        b, count = self.batch, len(active)
        general = self.static_shapes
        vocab = self.vocab_size
        # Token ids where they are, vocab_size (a column the scatter drops) elsewhere. A compiling
        # backend pads to max_model_len so the width is not a graph dimension.
        width = self.max_model_len if general else int(b.num_tokens[active].max())
        tokens = b.token_ids[active, :width].astype(np.int64)  # [A, W]
        pos = np.arange(width)[None, :]
        prompt_len = b.num_prompt_tokens[active][:, None]
        prompt_ids = np.full((rows, width), vocab, dtype=np.int64)
        prompt_ids[:count] = np.where(pos < prompt_len, tokens, vocab)
        output_ids = np.full((rows, width), vocab, dtype=np.int64)
        generated = (pos >= prompt_len) & (pos < b.num_tokens[active][:, None])
        output_ids[:count] = np.where(generated, tokens, vocab)
        return PenaltyTensors(_padded(b.presence_penalty[active], rows, 0.0),
                              _padded(b.frequency_penalty[active], rows, 0.0),
                              _padded(b.repetition_penalty[active], rows, 1.0),
                              output_ids, prompt_ids)


def _padded(values: np.ndarray, rows: int, fill: float) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``rows`` entries (padding rows of a bucket)."""
    out = np.full(rows, fill, dtype=values.dtype)
    out[:len(values)] = values
    return out
