"""One step of the model for a scheduled batch, after vLLM's TPU model runner.

Per step: apply the scheduler's changes to the persistent batch; lay the step out with numpy
(token ids, positions, slot mapping, block tables), padded to a token bucket on a compiling
backend; copy it to the device; then run four pieces, each its own graph on XLA: the forward (which
also writes the KV cache), the selection of each request's last hidden state, the logits, and
sampling. A request still in chunked prefill is sampled with the batch and its token thrown away.

On XLA every piece comes from a finite set (token bucket, request bucket, rank filters and
logprobs on or off) and ``warm_up`` compiles all of it, so serving compiles nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from meshserve.config import ModelConfig
from meshserve.contracts.sampling import MAX_LOGPROBS
from meshserve.contracts.step import RunnerOutput, SchedulerOutput
from meshserve.contracts.tokens import TokenLogprobs
from meshserve.runner.attention import KVCache, StepLayout, select_attention
from meshserve.runner.buckets import (pick_bucket, reachable_request_buckets, request_buckets,
                                     token_buckets)
from meshserve.runner.input_batch import InputBatch
from meshserve.runner.loader import LoadedModel
from meshserve.runner.models.llama import LlamaForCausalLM, Rotary
from meshserve.runner.sampler import PenaltyTensors, SamplerOutput, SamplingTensors, sample
from meshserve.spmd.backend import Backend
from meshserve.spmd.sharding import (KV_CACHE_SPEC, kv_head_copies, plan_sharding, token_spec,
                                     weight_spec)

logger = logging.getLogger("meshserve.runner")


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       tensor_parallel_size: int = 1) -> int:
    """Bytes one KV block takes over all layers: keys and values, KV heads repeated for the mesh."""
    kv_heads = config.num_key_value_heads * kv_head_copies(config, tensor_parallel_size)
    per_layer = 2 * block_size * kv_heads * config.head_dim
    return per_layer * config.num_hidden_layers * torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    pieces: int  # compiled pieces run: every (piece, bucket) combination serving can produce
    new_graphs: int  # growth of torch_xla's compiled-graph count
    seconds: float


class ModelRunner:
    """Owns the model weights, the KV cache and the persistent batch of one engine."""

    def __init__(self, loaded: LoadedModel, backend: Backend, dtype: torch.dtype, *,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, bucket_gap: int = 0, seed: int = 0) -> None:
        self.backend = backend
        self.device = backend.device
        self.plan = plan_sharding(loaded.config, backend.mesh)
        self.config = self.plan.config  # KV heads as the mesh holds them
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.attention = select_attention(backend, self.config, block_size, max_num_seqs)
        self.model = self._build_model(loaded, max_model_len)
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_req)
        self.token_buckets = token_buckets(max_num_batched_tokens, bucket_gap)
        self.request_buckets = request_buckets(max_num_seqs)
        self.kv_caches: list[KVCache] = []
        self.warm_up_report: WarmUpReport | None = None
        # Draws for unseeded requests; the same seed on every host keeps lockstep replicas equal.
        self.rng = np.random.default_rng(seed)

    def _build_model(self, loaded: LoadedModel, max_model_len: int) -> LlamaForCausalLM:
        rotary = Rotary(loaded.rope_inv_freq, loaded.rope_attention_scaling,
                        max_model_len).to(self.device)
        # Build on the meta device: parameters are assigned from the loaded weights, not initialised.
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config, rotary, self.attention)
        weights = {name: t.to(self.dtype) for name, t in self.plan.weights(loaded.weights).items()}
        model.load_state_dict(weights, strict=True, assign=True)
        if not self.plan.sharded:
            # One device: fewer, larger matmuls. A mesh keeps q/k/v and gate/up apart so each
            # splits cleanly by output columns.
            model.fuse_projections()
        placed = {name: self.backend.to_device(t, weight_spec(name, t.ndim))
                  for name, t in model.state_dict().items()}
        model.load_state_dict(placed, strict=True, assign=True)
        return model.eval()

    # ------------------------------------------------------------------ KV cache handshake
    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shapes = self.attention.cache_shapes(num_blocks, self.block_size, c.num_key_value_heads,
                                             c.head_dim)
        self.kv_caches = [tuple(self.backend.zeros(shape, self.dtype, KV_CACHE_SPEC)
                                for shape in shapes) for _ in range(c.num_hidden_layers)]
        # Materialise it now: a cache still pending as "zeros" would make the first forward a
        # graph that serving never sees again.
        self.backend.sync()

    # ------------------------------------------------------------------ warm-up
    @torch.no_grad()  # torch_xla cannot run under inference_mode
    def warm_up(self) -> None:
        """Compile every graph serving can produce (nothing to do on an eager backend)."""
        if not self.backend.static_shapes:
            return
        pairs = [(t, r) for t in self.token_buckets for r in self._request_buckets_for(t)]
        rows = sorted({r for _, r in pairs})
        samplers = list(itertools.product((False, True), (0, MAX_LOGPROBS)))
        total = len(self.token_buckets) + len(pairs) + (1 + len(samplers)) * len(rows)
        counter = itertools.count(1)

        def announce(what: str) -> None:
            logger.info("compiling graph %d/%d: %s", next(counter), total, what)

        start, before = time.perf_counter(), self.backend.num_compiled_graphs()
        selected: dict[int, torch.Tensor] = {}
        for t in self.token_buckets:
            announce(f"forward, {t} tokens")
            hidden = self._forward(self._layout(np.zeros(0, dtype=np.int32), padded=t))
            for r in self._request_buckets_for(t):
                announce(f"last-token selection, {t} tokens x {r} requests")
                selected[r] = self._select(hidden, np.zeros(r, dtype=np.int64))
        nothing = np.zeros(0, dtype=np.int64)
        for r in rows:
            announce(f"logits, {r} requests")
            logits = self._logits(selected[r])
            tensors = self._sampling_tensors(nothing, nothing.astype(bool), r)
            for ranked, k in samplers:
                announce(f"sampling, {r} requests, {'with' if ranked else 'no'} top-k/top-p, "
                         f"{'with' if k else 'no'} logprobs")
                self._sample(logits, replace(tensors, use_top_k=ranked, use_top_p=ranked), k)
        report = WarmUpReport(total, self.backend.num_compiled_graphs() - before,
                              time.perf_counter() - start)
        logger.info("warm-up: %d pieces, %d new graphs, %.1fs", report.pieces,
                    report.new_graphs, report.seconds)
        self.warm_up_report = report

    def _request_buckets_for(self, tokens: int) -> list[int]:
        return reachable_request_buckets(self.request_buckets,
                                         min(tokens, self.max_num_batched_tokens))

    # ------------------------------------------------------------------ one step
    def _apply_step(self, step: SchedulerOutput) -> None:
        batch = self.batch
        for request_id in step.finished_request_ids:
            batch.remove(request_id)
        for new in step.new_requests:
            batch.add(new)
        for running in step.running_requests:
            row = batch.index[running.request_id]
            batch.append_blocks(row, running.new_block_ids)
            batch.num_computed_tokens[row] = running.num_computed_tokens
        batch.condense()

    @torch.no_grad()  # torch_xla cannot run under inference_mode
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        self._apply_step(step)
        if step.is_empty:
            return RunnerOutput({})
        batch = self.batch
        scheduled = np.array([step.num_scheduled_tokens.get(batch.req_ids[i], 0)
                              for i in range(batch.num_reqs)], dtype=np.int32)
        active = np.flatnonzero(scheduled)  # rows with work this step
        layout = self._layout(scheduled)
        computed = batch.num_computed_tokens[active] + scheduled[active]
        completes = computed == batch.num_tokens[active]  # the sampled token is real
        rows = len(active)
        if self.backend.static_shapes:
            rows = pick_bucket(self.request_buckets, rows)
        logits_index = np.zeros(rows, dtype=np.int64)  # padding rows read token 0, then drop
        logits_index[:len(active)] = layout.query_start_loc[1:][active] - 1
        num_logprobs = self._num_logprobs(active, completes)
        hidden = self._forward(layout)
        logits = self._logits(self._select(hidden, logits_index))
        out = self._sample(logits, self._sampling_tensors(active, completes, rows), num_logprobs)
        return self._collect(out, active, completes, num_logprobs)

    def _collect(self, out: SamplerOutput, active: np.ndarray, completes: np.ndarray,
                 num_logprobs: int) -> RunnerOutput:
        batch = self.batch
        tokens = out.token_ids.cpu().numpy()
        result: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        if num_logprobs:
            sampled_lp = out.sampled_logprobs.cpu().numpy()
            top_ids = out.top_ids.cpu().numpy()
            top_lp = out.top_logprobs.cpu().numpy()
        for i, row in enumerate(active):
            if not completes[i]:
                continue
            request_id = batch.req_ids[row]
            token = int(tokens[i])
            result[request_id] = token
            batch.token_ids[row, batch.num_tokens[row]] = token
            batch.num_tokens[row] += 1
            k = batch.params[row].logprobs
            if k is not None:
                logprobs[request_id] = (float(sampled_lp[i]), tuple(top_ids[i, :k].tolist()),
                                        tuple(top_lp[i, :k].tolist()))
        return RunnerOutput(result, logprobs)

    # ------------------------------------------------------------------ the compiled pieces
    def _forward(self, layout: StepLayout) -> torch.Tensor:
        meta = self.attention.metadata(layout, self._put)
        hidden = self.model(self._put(layout.input_ids, True), self._put(layout.positions, True),
                            self.kv_caches, meta)  # [T, hidden]
        self.backend.sync()  # one graph per token bucket, KV writes included
        return hidden

    def _select(self, hidden: torch.Tensor, logits_index: np.ndarray) -> torch.Tensor:
        selected = hidden[self._put(logits_index)]  # [R, hidden]
        self.backend.sync()  # one graph per (token bucket, request bucket)
        return selected

    def _logits(self, selected: torch.Tensor) -> torch.Tensor:
        # Gathered whole: the lm_head leaves logits split by vocabulary, and the sampler's sort
        # and cumsum along a split axis partition badly (seconds per step on XLA:CPU).
        logits = self.backend.replicate(self.model.compute_logits(selected))  # [R, vocab]
        self.backend.sync()  # one graph per request bucket
        return logits

    def _sample(self, logits: torch.Tensor, tensors: SamplingTensors,
                num_logprobs: int) -> SamplerOutput:
        out = sample(logits, tensors, num_logprobs)
        self.backend.sync()  # one graph per request bucket, with and without logprobs
        return out

    def _put(self, array: np.ndarray, token_major: bool = False) -> torch.Tensor:
        return self.backend.to_device(torch.from_numpy(array),
                                      token_spec(array.ndim) if token_major else None)

    # ------------------------------------------------------------------ inputs, on the CPU
    def _layout(self, scheduled: np.ndarray, padded: int | None = None) -> StepLayout:
        """Token ids, positions and slot mapping of a step, padded to its token bucket."""
        batch, bs = self.batch, self.block_size
        n, total = len(scheduled), int(scheduled.sum())
        if padded is None:
            padded = pick_bucket(self.token_buckets, total) if self.backend.static_shapes else total
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
        return StepLayout(input_ids, positions, slots, rows, starts, seq_lens,
                          batch.block_table[:n])

    def _num_logprobs(self, active: np.ndarray, completes: np.ndarray) -> int:
        wanted = [self.batch.params[r].logprobs for r, c in zip(active, completes) if c]
        wanted = [k for k in wanted if k is not None]
        if not wanted:
            return 0
        # A compiling backend always gathers the most any request may ask for, so k is not a
        # graph dimension; eager takes what this batch needs (even 0 needs the sampled logprob).
        return MAX_LOGPROBS if self.backend.static_shapes else max(max(wanted), 1)

    def _sampling_tensors(self, active: np.ndarray, completes: np.ndarray,
                          rows: int) -> SamplingTensors:
        b, count = self.batch, len(active)
        temperature = np.zeros(rows, dtype=np.float32)
        temperature[:count] = np.where(completes, b.temperature[active], 0.0)
        uniform = np.zeros(rows, dtype=np.float32)
        for i, row in enumerate(active):
            if completes[i] and temperature[i] > 0:
                uniform[i] = self._uniform(row)
        top_k = _padded(b.top_k[active].astype(np.int64), rows, 0)
        top_p = _padded(b.top_p[active], rows, 1.0)
        min_p = _padded(b.min_p[active], rows, 0.0)
        sampling = temperature > 0
        use_top_k = bool((top_k[sampling] > 0).any())
        use_top_p = bool((top_p[sampling] < 1).any())
        if self.backend.static_shapes:
            # A compiling backend runs the general path (greedy rows, min-p and penalties
            # included) whatever the batch asks for. Only the rank filters stay optional, as one
            # flag: they need a sort of the vocabulary (~55 ms per step on XLA:CPU) that most
            # batches can skip. So two sampler graphs per request bucket, times logprobs on/off.
            all_greedy, use_min_p = False, True
            use_top_k = use_top_p = use_top_k or use_top_p
        else:
            all_greedy, use_min_p = not sampling.any(), bool((min_p[sampling] > 0).any())
        return SamplingTensors(
            temperature=self._put(temperature),
            top_k=self._put(top_k),
            top_p=self._put(top_p),
            min_p=self._put(min_p),
            uniform=self._put(uniform),
            all_greedy=all_greedy,
            use_top_k=use_top_k,
            use_top_p=use_top_p,
            use_min_p=use_min_p,
            penalties=self._penalty_tensors(active, rows),
        )

    def _uniform(self, row: int) -> float:
        seed = self.batch.params[row].seed
        if seed is None:
            return float(self.rng.random())
        # Keyed by (seed, sample, token index): independent of batch, chunking and preemption.
        index = int(self.batch.num_tokens[row] - self.batch.num_prompt_tokens[row])
        return float(np.random.default_rng([seed, int(self.batch.sample_index[row]), index]).random())

    def _penalty_tensors(self, active: np.ndarray, rows: int) -> PenaltyTensors | None:
        b, count = self.batch, len(active)
        general = self.backend.static_shapes
        if not general and not any(b.params[r].needs_penalties for r in active):
            return None
        vocab = self.config.vocab_size
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
        presence = _padded(b.presence_penalty[active], rows, 0.0)
        frequency = _padded(b.frequency_penalty[active], rows, 0.0)
        repetition = _padded(b.repetition_penalty[active], rows, 1.0)
        return PenaltyTensors(*(self._put(a) for a in
                                (presence, frequency, repetition, output_ids, prompt_ids)))


def _padded(values: np.ndarray, rows: int, fill: float) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``rows`` entries (padding rows of a bucket)."""
    out = np.full(rows, fill, dtype=values.dtype)
    out[:len(values)] = values
    return out
