"""The token-level engine of one host: add_request / step / abort.

It joins the device-free scheduler and the device-bound runner, and speaks token ids only; text
(tokenizer, detokenization, stop strings) lives at the edges (``LLM`` and the HTTP ingress).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

import torch

from meshserve.config import EngineConfig
from meshserve.contracts.prompt import PromptLimits
from meshserve.contracts.sampling import FinishReason, SamplingParams
from meshserve.contracts.step import RunnerOutput, SchedulerOutput
from meshserve.contracts.tokens import EngineStats, TokenDelta, TokenLogprobs
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.cpu_wait import cpu_wait_seconds
from meshserve.engine.request import Request
from meshserve.engine.scheduler import Scheduler
from meshserve.runner.loader import LoadedModel, generation_defaults, load_model
from meshserve.runner.model_runner import ModelRunner, kv_bytes_per_block
from meshserve.spmd.backend import Backend, create_backend
from meshserve.structured.manager import StructuredOutputManager

logger = logging.getLogger("meshserve.engine")


def resolve_dtype(dtype: str, backend: Backend) -> torch.dtype:
    """``auto``: what the backend computes natively (bfloat16 on a TPU or a CPU with bf16 matrix
    instructions, else float32); says which and why, once, at start-up."""
    if dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[dtype]
    picked, why = backend.auto_dtype()
    print(f"meshserve: dtype auto -> {str(picked).removeprefix('torch.')}: {why}",
          file=sys.stderr, flush=True)
    return picked


class EngineCore:
    """One engine: a scheduler, a block manager and a runner over one model.

    Construction loads the weights onto the device, then sizes the KV cache from the memory left
    (``kv_blocks_available``), allocates it and warms up. A replica of several hosts passes
    ``allocate=False`` instead: each host reports what it could hold, the replica takes the
    minimum, and every host calls ``allocate`` with it (vLLM's sizing handshake, across hosts).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 allocate: bool = True) -> None:
        self._started = time.perf_counter()
        self.config = config
        self.backend = create_backend(config.device, config.parallel, config.compile_cache_dir)
        dtype = resolve_dtype(config.dtype, self.backend)
        self.loaded = loaded or load_model(config.model, dtype=dtype)
        sched = config.scheduler
        model_max = self.loaded.config.max_position_embeddings
        self._wanted_len = min(sched.max_model_len or model_max, model_max)
        self.token_budget = sched.max_num_batched_tokens or self.backend.default_token_budget
        self.runner = ModelRunner(
            self.loaded, self.backend, dtype, block_size=config.cache.block_size,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=self.token_budget,
            max_positions=self._wanted_len, bucket_gap=sched.bucket_gap, seed=config.seed,
            enforce_eager=config.enforce_eager)
        self.eos_token_ids = self.loaded.config.eos_token_ids
        # Steps run on this host and the seconds spent in them (EngineStats; /metrics): the
        # engine's own time per step, to tell it from what serving adds around it. Of those
        # seconds, cpu_wait_seconds is how long the stepping thread waited for a core that
        # another thread or process held (see cpu_wait.py).
        self.num_steps = 0
        self.execute_seconds = 0.0
        self.cpu_wait_seconds = 0.0
        self.structured = StructuredOutputManager(self.loaded.tokenizer,
                                                  self.loaded.config.vocab_size, self.eos_token_ids)
        # What a request that leaves a sampling field unset gets (vLLM's --generation-config).
        self.generation_defaults = (generation_defaults(self.loaded.path)
                                    if config.generation_config == "auto" else {})
        shown = ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items())
        print(f"meshserve: generation defaults: {shown or 'neutral'} (generation_config="
              f"{config.generation_config})", file=sys.stderr, flush=True)
        # Blocks this host can hold (an explicit num_kv_blocks is taken as it is).
        self.kv_blocks_available = config.cache.num_kv_blocks or self._measure_kv_blocks(dtype)
        if allocate:
            self.allocate(self.kv_blocks_available)

    def _measure_kv_blocks(self, dtype: torch.dtype) -> int:
        """Blocks that fit in the memory left after the weights: a fraction of the device's
        free memory (HBM on a TPU) or of the host's available RAM, capped at what every sequence
        at full length needs."""
        cache, sched = self.config.cache, self.config.scheduler
        free, fraction = self.backend.free_memory(), cache.memory_fraction
        per_block = kv_bytes_per_block(self.loaded.config, cache.block_size, dtype,
                                       self.config.parallel.tensor_parallel_size)
        if self.backend.on_tpu:  # the cache is split over the model axis; HBM is per chip
            per_block //= self.config.parallel.tensor_parallel_size
            fraction = cache.device_memory_fraction
        fits = int(free * fraction // per_block)
        # No use holding more than every sequence at full length (+1 for the null block).
        return max(min(fits, sched.max_num_seqs * -(-self._wanted_len // cache.block_size) + 1),
                   2)

    def allocate(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (the null block included), warm up, and open for
        requests. An explicit max_model_len the cache cannot hold is an error; a default one is
        capped at what it holds."""
        block_size = self.config.cache.block_size
        self.max_model_len = self._wanted_len
        capacity = (num_blocks - 1) * block_size
        if capacity < self.max_model_len:
            if self.config.scheduler.max_model_len is not None:
                raise ValueError(
                    f"max_model_len: {self.max_model_len} does not fit in {num_blocks} KV blocks "
                    f"of {block_size} tokens; raise num_kv_blocks or lower max_model_len to at "
                    f"most {capacity}")
            self.max_model_len = capacity
        if self.max_model_len < 2:
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks hold no sequence")
        self.runner.allocate_kv_cache(num_blocks, self.max_model_len)
        self.runner.warm_up()  # compiles every program, so serving never does
        self.block_manager = BlockManager(num_blocks, block_size,
                                          self.config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(replace(self.config.scheduler, max_model_len=self.max_model_len,
                                           max_num_batched_tokens=self.token_budget),
                                   self.block_manager)
        self.prompt_limits = PromptLimits(self.max_model_len, self.loaded.config.vocab_size)
        logger.info("engine ready in %.1fs: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
                    time.perf_counter() - self._started, self.loaded.name, self.backend.name,
                    num_blocks, block_size, self.max_model_len)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    sample_index: int = 0) -> None:
        """Queue a request; invalid input raises ValueError and changes nothing."""
        self.prompt_limits.check(prompt_token_ids)
        # A constrained request's grammar starts compiling now; the scheduler admits it when done.
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                          grammar=self.structured.start(params))
        self.scheduler.add_request(request, sample_index)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[TokenDelta]:
        """Schedule, execute and apply one step; return what changed."""
        step = self.schedule()
        output = self.execute(step)
        return self.apply(step, output)

    def schedule(self) -> SchedulerOutput:
        """The scheduler's next step, carrying the grammar masks of the constrained requests it
        samples: what the lead of a multi-host replica broadcasts."""
        step = self.scheduler.schedule()
        if step.is_empty:  # what waits, waits for its grammar: block on that, not spin
            self.structured.wait_for_grammars(self.scheduler.waiting)
        return self.structured.attach_bitmask(step, self.scheduler.requests)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        """Run a step on this host's runner (followers of a multi-host replica call only this)."""
        if step.is_empty and not step.finished_request_ids:
            return RunnerOutput({})
        start, waited = time.perf_counter(), cpu_wait_seconds()
        output = self.runner.execute(step)  # returns once the sampled tokens are on the host
        self.execute_seconds += time.perf_counter() - start
        if waited is not None:
            self.cpu_wait_seconds += cpu_wait_seconds() - waited
        self.num_steps += 1
        return output

    def apply(self, step: SchedulerOutput, output: RunnerOutput) -> list[TokenDelta]:
        self.structured.accept(output, self.scheduler.requests)  # before update reads the grammars
        for request_id, run in output.prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(run)
        deltas = []
        for request in self.scheduler.update(step, output):
            lp = output.logprobs.get(request.request_id)
            deltas.append(self._delta(request, (request.output_token_ids[-1],),
                                      None if lp is None else (lp,)))
        return deltas

    def _delta(self, request: Request, tokens: tuple[int, ...],
               logprobs: tuple[TokenLogprobs, ...] | None) -> TokenDelta:
        reason = request.finish_reason
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and request.prompt_logprobs is not None:
            prompt_logprobs, request.prompt_logprobs = tuple(request.prompt_logprobs), None
        return TokenDelta(request.request_id, tokens, logprobs,
                          None if reason is None else FinishReason(reason).value,
                          len(request.prompt_token_ids), request.num_cached_tokens,
                          prompt_logprobs)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           bm.num_free_blocks, bm.num_total_blocks, bm.usage,
                           bm.stats.queried_tokens, bm.stats.hit_tokens,
                           self.scheduler.num_preemptions, self.num_steps,
                           self.execute_seconds, self.cpu_wait_seconds)
