"""One step of the model for a scheduled batch, after vLLM's TPU model runner.

Per step: apply the scheduler's changes to the persistent batch; compute token ids, positions and
the slot mapping with numpy; copy them to the device; run the forward; take hidden states of the
last scheduled token of each request only; compute logits; sample. A request still in chunked
prefill is sampled with the batch and its token thrown away.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from meshserve.config import ModelConfig
from meshserve.engine.scheduler import RunnerOutput, SchedulerOutput
from meshserve.runner.attention import AttentionMetadata
from meshserve.runner.buckets import pick_bucket, request_buckets, token_buckets
from meshserve.runner.input_batch import InputBatch
from meshserve.runner.loader import LoadedModel
from meshserve.runner.models.llama import KVCache, LlamaForCausalLM, Rotary
from meshserve.runner.sampler import PenaltyTensors, SamplingTensors, sample
from meshserve.spmd.backend import Backend

logger = logging.getLogger("meshserve.runner")


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers (keys and values)."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim
    return per_layer * config.num_hidden_layers * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    """Owns the model weights, the KV cache and the persistent batch of one engine."""

    def __init__(self, loaded: LoadedModel, backend: Backend, dtype: torch.dtype, *,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, bucket_gap: int = 0, seed: int = 0) -> None:
        self.backend = backend
        self.device = backend.device
        self.config = loaded.config
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model = self._build_model(loaded, max_model_len)
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_req)
        self.token_buckets = token_buckets(max_num_batched_tokens, bucket_gap)
        self.request_buckets = request_buckets(max_num_seqs)
        self.kv_caches: list[KVCache] = []
        # Draws for unseeded requests; the same seed on every host keeps lockstep replicas equal.
        self.rng = np.random.default_rng(seed)

    def _build_model(self, loaded: LoadedModel, max_model_len: int) -> LlamaForCausalLM:
        rotary = Rotary(loaded.rope_inv_freq, loaded.rope_attention_scaling,
                        max_model_len).to(self.device)
        # Build on the meta device: parameters are assigned from the loaded weights, not initialised.
        with torch.device("meta"):
            model = LlamaForCausalLM(loaded.config, rotary)
        weights = {name: t.to(self.device, self.dtype) for name, t in loaded.weights.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        if not self.backend.static_shapes:
            model.fuse_projections()
        return model.eval()

    # ------------------------------------------------------------------ KV cache handshake
    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(c.num_hidden_layers)
        ]

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

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        self._apply_step(step)
        if step.is_empty:
            return RunnerOutput({})
        batch = self.batch
        n = batch.num_reqs
        scheduled = np.array([step.num_scheduled_tokens.get(batch.req_ids[i], 0)
                              for i in range(n)], dtype=np.int32)
        active = np.flatnonzero(scheduled)  # rows with work this step
        inputs = self._prepare_inputs(scheduled)
        hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches,
                            inputs["meta"])
        logits = self.model.compute_logits(hidden[inputs["logits_index"]])  # [R, V]

        computed = batch.num_computed_tokens[active] + scheduled[active]
        completes = computed == batch.num_tokens[active]  # the sampled token is real
        num_logprobs = self._num_logprobs(active, completes)
        tensors = self._sampling_tensors(active, completes, logits.shape[0])
        out = sample(logits, tensors, num_logprobs)
        self.backend.sync()
        tokens = out.token_ids.cpu().numpy()
        result: dict[str, int] = {}
        logprobs: dict[str, tuple[float, tuple[int, ...], tuple[float, ...]]] = {}
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

    def _prepare_inputs(self, scheduled: np.ndarray) -> dict:
        """Token ids, positions, slot mapping and attention metadata, computed with numpy."""
        batch, bs = self.batch, self.block_size
        n = len(scheduled)
        total = int(scheduled.sum())
        padded = pick_bucket(self.token_buckets, total) if self.backend.static_shapes else total
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(scheduled, out=starts[1:])
        rows = np.repeat(np.arange(n), scheduled)  # [T] owning row of each token
        offsets = np.arange(total) - starts[rows]
        positions = np.zeros(padded, dtype=np.int64)
        positions[:total] = batch.num_computed_tokens[rows] + offsets
        input_ids = np.zeros(padded, dtype=np.int64)
        input_ids[:total] = batch.token_ids[rows, positions[:total]]
        slots = np.zeros(padded, dtype=np.int64)  # padding writes into the null block
        pos = positions[:total]
        slots[:total] = batch.block_table[rows, pos // bs].astype(np.int64) * bs + pos % bs

        seq_lens = batch.num_computed_tokens[:n] + scheduled
        decode_rows = np.flatnonzero(scheduled == 1)
        prefill_rows = np.flatnonzero(scheduled > 1)
        max_blocks = int(-(-seq_lens[decode_rows].max() // bs)) if len(decode_rows) else 0
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            decode_token_index=torch.from_numpy(starts[decode_rows]).to(dev),
            decode_block_tables=torch.from_numpy(
                batch.block_table[decode_rows, :max_blocks].astype(np.int64)).to(dev),
            decode_seq_lens=torch.from_numpy(seq_lens[decode_rows].astype(np.int64)).to(dev),
            prefills=tuple((int(starts[r]), int(scheduled[r]), int(seq_lens[r]))
                           for r in prefill_rows),
            prefill_block_tables=tuple(
                torch.from_numpy(batch.block_table[r, :-(-seq_lens[r] // bs)].astype(np.int64)).to(dev)
                for r in prefill_rows),
            sliding_window=self.config.sliding_window,
        )
        active = np.flatnonzero(scheduled)
        logits_index = starts[1:][active] - 1
        return {
            "input_ids": torch.from_numpy(input_ids).to(dev),
            "positions": torch.from_numpy(positions).to(dev),
            "meta": meta,
            "logits_index": torch.from_numpy(logits_index).to(dev),
        }

    def _num_logprobs(self, active: np.ndarray, completes: np.ndarray) -> int:
        wanted = [self.batch.params[r].logprobs for r, c in zip(active, completes) if c]
        wanted = [k for k in wanted if k is not None]
        # Even logprobs=0 needs the graph that computes the sampled token's logprob.
        return max(max(wanted), 1) if wanted else 0

    def _sampling_tensors(self, active: np.ndarray, completes: np.ndarray,
                          rows: int) -> SamplingTensors:
        b = self.batch
        temperature = np.zeros(rows, dtype=np.float32)
        temperature[:len(active)] = np.where(completes, b.temperature[active], 0.0)
        uniform = np.zeros(rows, dtype=np.float32)
        for i, row in enumerate(active):
            if completes[i] and temperature[i] > 0:
                uniform[i] = self._uniform(row)
        top_k = np.zeros(rows, dtype=np.int64)
        top_k[:len(active)] = b.top_k[active]
        top_p = np.ones(rows, dtype=np.float32)
        top_p[:len(active)] = b.top_p[active]
        min_p = np.zeros(rows, dtype=np.float32)
        min_p[:len(active)] = b.min_p[active]
        sampling = temperature > 0
        dev = self.device
        return SamplingTensors(
            temperature=torch.from_numpy(temperature).to(dev),
            top_k=torch.from_numpy(top_k).to(dev),
            top_p=torch.from_numpy(top_p).to(dev),
            min_p=torch.from_numpy(min_p).to(dev),
            uniform=torch.from_numpy(uniform).to(dev),
            all_greedy=not sampling.any(),
            use_top_k=bool((top_k[sampling] > 0).any()),
            use_top_p=bool((top_p[sampling] < 1).any()),
            use_min_p=bool((min_p[sampling] > 0).any()),
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
        b = self.batch
        if not any(b.params[r].needs_penalties for r in active):
            return None
        vocab = self.config.vocab_size
        prompt_lens = b.num_prompt_tokens[active]
        output_lens = b.num_tokens[active] - prompt_lens
        output_ids = np.full((rows, max(int(output_lens.max()), 1)), vocab, dtype=np.int64)
        prompt_ids = np.full((rows, int(prompt_lens.max())), vocab, dtype=np.int64)
        presence = np.zeros(rows, dtype=np.float32)
        frequency = np.zeros(rows, dtype=np.float32)
        repetition = np.ones(rows, dtype=np.float32)
        for i, row in enumerate(active):
            p, o = prompt_lens[i], output_lens[i]
            prompt_ids[i, :p] = b.token_ids[row, :p]
            output_ids[i, :o] = b.token_ids[row, p:p + o]
            presence[i] = b.presence_penalty[row]
            frequency[i] = b.frequency_penalty[row]
            repetition[i] = b.repetition_penalty[row]
        dev = self.device
        return PenaltyTensors(*(torch.from_numpy(a).to(dev) for a in
                                (presence, frequency, repetition, output_ids, prompt_ids)))
