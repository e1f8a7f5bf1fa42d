"""One step of the model for a scheduled batch, after vLLM's TPU model runner.

Per step: apply the scheduler's changes to the persistent batch; lay the step out with numpy
(``inputs.py``: token ids, positions, slot mapping, block tables, sampling columns), padded to a
token bucket on xla; copy it to the device; then run four pieces: the forward (which also writes
the KV cache), the selection of each sampled row's hidden state, the logits, and sampling. A
request still in chunked prefill is sampled with the batch and its token thrown away.

Each piece is a ``CompiledPiece`` (``compiled.py``): compiled with torch.compile at warm-up and
then dispatched without dynamo. On xla every piece comes from a finite set of static shapes
(token and context bucket, request bucket, greedy alone or general, rank filters and logprobs
on or off) and warm-up compiles each; on cpu the forward, the logits and the grammar mask are
compiled once with dynamic sizes by inductor (selection and the rest of sampling stay eager: one
or a few ops each). ``enforce_eager`` skips compilation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from meshserve.config import ModelConfig
from meshserve.contracts.sampling import MAX_LOGPROBS
from meshserve.contracts.step import RunnerOutput, SchedulerOutput
from meshserve.contracts.tokens import TokenLogprobs
from meshserve.runner.attention import AttentionMetadata, KVCache, select_attention
from meshserve.runner.buckets import request_buckets, token_buckets
from meshserve.runner.compiled import CompiledPiece
from meshserve.runner.grammar_mask import apply_grammar_bitmask
from meshserve.runner.input_batch import InputBatch
from meshserve.runner.inputs import PreparedStep, SamplingArrays, StepInputs
from meshserve.runner.loader import LoadedModel
from meshserve.runner.models.llama import LlamaForCausalLM, Rotary
from meshserve.runner.sampler import SamplerOutput, SamplingTensors, sample
from meshserve.runner.warmup import WarmUpReport, warm_up
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


def select_rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return hidden[index]  # [R, hidden]


class ModelRunner:
    """Owns the model weights, the KV cache and the persistent batch of one engine."""

    def __init__(self, loaded: LoadedModel, backend: Backend, dtype: torch.dtype, *,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_positions: int, bucket_gap: int = 0, seed: int = 0,
                 enforce_eager: bool = False) -> None:
        """``max_positions`` bounds the context (rotary tables); the KV cache, and with it the
        persistent batch, comes with ``allocate_kv_cache`` once the engine has sized it."""
        self.backend = backend
        self.device = backend.device
        self.plan = plan_sharding(loaded.config, backend.mesh)
        self.config = self.plan.config  # KV heads as the mesh holds them
        self.dtype = dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.bucket_gap = bucket_gap
        self.seed = seed
        self.enforce_eager = enforce_eager
        self.attention = select_attention(backend, self.config, max_num_seqs)
        self.model = self._build_model(loaded, max_positions)
        self.max_model_len = 0  # set by allocate_kv_cache
        self.batch: InputBatch | None = None
        self.inputs: StepInputs | None = None
        self.kv_caches: list[KVCache] = []
        self.bound_caches: tuple[Any, ...] = ()  # what each layer holds: a cache id on cpu
        self.warm_up_report: WarmUpReport | None = None
        self.forward = self._piece(self.model.forward, compile_on_cpu=True)
        self.select = self._piece(select_rows, compile_on_cpu=False)
        self.logits = self._piece(self._compute_logits, compile_on_cpu=True)
        self.sample = self._piece(sample, compile_on_cpu=False)
        # The eager sampler's grammar mask, compiled on its own (xla compiles it into sample).
        self.grammar_mask = (None if backend.static_shapes
                             else self._piece(apply_grammar_bitmask, compile_on_cpu=True))
        self.prompt_logprobs = self._piece(self._prompt_logprobs, compile_on_cpu=False)

    def _piece(self, fn, *, compile_on_cpu: bool) -> CompiledPiece:
        backend = self.backend
        eager = self.enforce_eager or (not backend.static_shapes and not compile_on_cpu)
        return CompiledPiece(fn, backend=backend.compile_backend, dynamic=not backend.static_shapes,
                             eager=eager, options=backend.compile_options(self.dtype),
                             cut=backend.sync)

    def _build_model(self, loaded: LoadedModel, max_positions: int) -> LlamaForCausalLM:
        rotary = Rotary(loaded.rope_inv_freq, loaded.rope_attention_scaling,
                        max_positions).to(self.dtype).to(self.device)
        # Build on the meta device: parameters are assigned from the loaded weights, not
        # initialised.
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config, rotary, self.attention)
        weights = {name: t.to(self.dtype) for name, t in self.plan.weights(loaded.weights).items()}
        model.load_state_dict(weights, strict=True, assign=True)
        if not self.plan.sharded:
            # One device: fewer, larger matmuls. A mesh keeps q/k/v and gate/up apart so each
            # splits cleanly by output columns. Compiled into inductor's generated GEMMs, gate
            # and up stay apart too: SiLU-and-multiply then runs in the up GEMM's epilogue
            # instead of as a pass of its own over a [T, 2 * intermediate] product.
            model.fuse_projections(gate_up=self.enforce_eager
                                   or not self.backend.generates_gemms(self.dtype))
        placed = {name: self.backend.to_device(t, weight_spec(name, t.ndim))
                  for name, t in model.state_dict().items()}
        model.load_state_dict(placed, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    # ------------------------------------------------------------------ KV cache handshake
    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate ``num_blocks`` blocks per layer and a persistent batch for sequences of up to
        ``max_model_len`` tokens."""
        self.max_model_len = max_model_len
        self.batch = InputBatch(self.max_num_seqs, max_model_len,
                                -(-max_model_len // self.block_size))
        self.inputs = StepInputs(
            self.batch, block_size=self.block_size, max_model_len=max_model_len,
            vocab_size=self.config.vocab_size,
            token_buckets=token_buckets(self.max_num_batched_tokens, self.bucket_gap),
            request_buckets=request_buckets(self.max_num_seqs),
            context_buckets=self.attention.context_buckets(self.batch.block_table.shape[1]),
            static_shapes=self.backend.static_shapes, seed=self.seed)
        c = self.config
        shapes = self.attention.cache_shapes(num_blocks, self.block_size, c.num_key_value_heads,
                                             c.head_dim)
        self.kv_caches = [tuple(self.backend.zeros(shape, self.dtype, KV_CACHE_SPEC)
                                for shape in shapes) for _ in range(c.num_hidden_layers)]
        # Materialise it now: a cache still pending as "zeros" would make the first forward a
        # graph that serving never sees again.
        self.backend.sync()
        self._bind([self.attention.bind_cache(cache) for cache in self.kv_caches])

    def _bind(self, caches: Sequence[Any]) -> None:
        """Hand the layers their caches; on xla, where a step returns new cache tensors, a
        compiled forward gets the old buffers donated to its outputs (the lazily traced path
        leaves buffers to torch_xla)."""
        self.bound_caches = tuple(caches)
        self.model.bind_kv_caches(self.bound_caches)
        if self.backend.name == "xla":
            self.kv_caches = list(self.bound_caches)
            if not self.enforce_eager:
                self.backend.donate([t for cache in self.kv_caches for t in cache])

    def forward_step(self, key: Hashable, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, *, warm_up: bool = False) -> torch.Tensor:
        """The forward piece, then the caches it returns bound for the next step."""
        call = self.forward.warm_up if warm_up else self.forward
        hidden, caches = call(key, input_ids, positions, meta)
        if not self.attention.writes_in_place:
            self._bind(caches)
        return hidden

    # ------------------------------------------------------------------ warm-up
    @torch.no_grad()  # torch_xla cannot run under inference_mode
    def warm_up(self) -> WarmUpReport:
        """Compile every program serving can run (see ``warmup.py``); serving compiles nothing."""
        self.warm_up_report = warm_up(self)
        return self.warm_up_report

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

    def prepare(self, step: SchedulerOutput) -> PreparedStep | None:
        """Take the step into the persistent batch and lay out its inputs (CPU only); None when
        it computes nothing."""
        self._apply_step(step)
        if step.is_empty:
            return None
        return self.inputs.prepare(step.num_scheduled_tokens, step.grammar)

    @torch.no_grad()  # torch_xla cannot run under inference_mode
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        prepared = self.prepare(step)
        if prepared is None:
            return RunnerOutput({})
        return self.run(prepared)

    @torch.no_grad()
    def run(self, p: PreparedStep) -> RunnerOutput:
        """Run a prepared step on the device and collect what it sampled."""
        out, hidden = self.run_pieces(p)
        output = self._collect(out, p.active, p.completes, p.num_logprobs)
        if p.prompt is not None:
            output.prompt_logprobs.update(self._collect_prompt(p, hidden))
        return output

    def run_pieces(self, p: PreparedStep) -> tuple[SamplerOutput, torch.Tensor]:
        """The four pieces, each dispatched to the program warm-up compiled for its shape;
        returns what was sampled and the step's hidden states."""
        static = self.backend.static_shapes
        tokens, rows = p.token_bucket, p.rows
        meta = self.attention.metadata(p.layout, self.to_device)
        hidden = self.forward_step((tokens, p.layout.context_blocks) if static else None,
                                   self.to_device(p.layout.input_ids, True),
                                   self.to_device(p.layout.positions, True), meta)  # [T, hidden]
        selected = self.select((tokens, rows) if static else None, hidden,
                               self.to_device(p.logits_index))  # [R, hidden]
        logits = self.logits(rows if static else None, selected)  # [R, vocab]
        s = p.sampling
        key = (rows, s.all_greedy, s.use_top_k or s.use_top_p, p.num_logprobs,
               s.grammar_bitmask is not None) if static else None
        tensors = self.sampling_tensors(s)
        if static:
            return self.sample(key, logits, tensors, p.num_logprobs), hidden
        return self.sample(key, logits, tensors, p.num_logprobs,
                           functools.partial(self.grammar_mask, None)), hidden

    def _prompt_logprobs(self, hidden: torch.Tensor, index: torch.Tensor, next_ids: torch.Tensor,
                         k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of each next prompt token ``next_ids`` ``[N]`` after the hidden
        state of token ``index`` ``[N]``, and the top ``k`` there: ([N], [N, k], [N, k])."""
        logprobs = torch.log_softmax(self._compute_logits(hidden[index]), dim=-1)  # [N, vocab]
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        return logprobs.gather(1, next_ids[:, None]).squeeze(1), top_ids, top_logprobs

    def _collect_prompt(self, p: PreparedStep,
                        hidden: torch.Tensor) -> dict[str, tuple[TokenLogprobs, ...]]:
        prompt = p.prompt
        k = MAX_LOGPROBS if self.backend.static_shapes else max(max(o[2] for o in prompt.owners), 1)
        key = p.token_bucket if self.backend.static_shapes else None
        target, top_ids, top_lp = (t.cpu().numpy() for t in self.prompt_logprobs(
            key, hidden, self.to_device(prompt.index), self.to_device(prompt.next_ids), k))
        out, at = {}, 0
        for request_id, count, wanted in prompt.owners:
            out[request_id] = tuple(
                (float(target[i]), tuple(top_ids[i, :wanted].tolist()),
                 tuple(top_lp[i, :wanted].tolist())) for i in range(at, at + count))
            at += count
        return out

    def _compute_logits(self, selected: torch.Tensor) -> torch.Tensor:
        # Gathered whole: the lm_head leaves logits split by vocabulary, and the sampler's sort
        # and cumsum along a split axis partition badly (seconds per step on XLA:CPU).
        return self.backend.replicate(self.model.compute_logits(selected))  # [R, vocab]

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
        for i in np.flatnonzero(completes):
            row = int(active[i])
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

    # ------------------------------------------------------------------ to the device
    def to_device(self, array: np.ndarray, token_major: bool = False) -> torch.Tensor:
        return self.backend.to_device(torch.from_numpy(array),
                                      token_spec(array.ndim) if token_major else None)

    def sampling_tensors(self, s: SamplingArrays) -> SamplingTensors[torch.Tensor]:
        return s.map(self.to_device)
