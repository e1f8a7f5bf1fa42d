"""What structured output costs per decode step: a batch of 32 with 8 JSON-schema requests.

Runs the same decode-bound batch twice on the bundled SmolLM2 (or ``--model``), once with no
constraint and once with ``--constrained`` of its requests held to a JSON schema, and reports per
step:

- **host**: the grammar work of ``EngineCore``'s step (each constrained request's matcher takes its
  token and fills its next mask; the step gathers the masks), timed inside the engine;
- **device**: ``apply_grammar_bitmask`` on the batch's ``[rows, vocab]`` logits, timed alone;
- **step**: the median wall time of a decode step of each run, and their difference (the whole
  cost as serving sees it, once the runner applies the mask).

The target is masks (host + device) under 5% of a decode step. Figures from a machine without an
accelerator are CPU figures.

    .venv/bin/python bench/structured.py [--batch 32] [--constrained 8] [--steps 32]
        [--dtype float32] [--device cpu] [--output bench/results/structured.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common import REPO_ROOT, bar_chart, machine_info, write_json

# Long, bounded output: twelve string fields keep a constrained request decoding for every step
# measured, with the grammar inside strings and between fields as it is in real extraction jobs.
SCHEMA = {"type": "object",
          "properties": {f"field_{i}": {"type": "string", "maxLength": 40} for i in range(12)},
          "required": [f"field_{i}" for i in range(12)]}
PROMPT = "Fill in a record with twelve text fields as JSON."


def _timed(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        sink[-1] += time.perf_counter() - started
        return result
    return wrapper


def run_batch(llm, batch: int, constrained: int, steps: int) -> dict[str, float]:
    """Decode ``steps`` steps of a full batch; median step time and mean grammar host time."""
    from meshserve import SamplingParams
    from meshserve.contracts.structured import StructuredOutputParams

    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 8, ignore_eos=True)
    held = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 8,
                          structured_outputs=StructuredOutputParams(json=SCHEMA))
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, held if i < constrained else free, sample_index=i)
    manager = engine.structured
    host: list[float] = []
    accept, attach = manager.accept, manager.attach_bitmask
    manager.accept, manager.attach_bitmask = _timed(accept, host), _timed(attach, host)
    step_times: list[float] = []
    try:
        while engine.has_unfinished and len(step_times) < steps + 2:
            host.append(0.0)
            started = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - started)
            if len(engine.scheduler.running) < batch:  # still admitting, or one has finished
                step_times.pop(), host.pop()
    finally:
        manager.accept, manager.attach_bitmask = accept, attach
        for i in range(batch):
            engine.abort(f"r{i}")
    # The first full steps include the prefill and warm caches.
    decode, grammar = step_times[2:], host[2:]
    return {"step_ms": 1e3 * statistics.median(decode),
            "host_ms": 1e3 * statistics.mean(grammar) if grammar else 0.0,
            "steps": len(decode)}


def device_mask_ms(rows: int, constrained: int, vocab: int, device: str, runner,
                   repeats: int = 50) -> float:
    """The mask as the runner's sampling piece applies it: on xla every row of the batch, with a
    flag saying which are constrained (one program per request bucket); on cpu the constrained
    rows alone, through the runner's compiled mask, written back in place."""
    from meshserve.runner.grammar_mask import apply_grammar_bitmask

    logits = torch.randn(rows, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32)
    flags = torch.zeros(rows, dtype=torch.bool)
    flags[:constrained] = True
    sync = None
    if device == "cpu":  # the eager sampler masks the constrained rows alone, in place
        index = torch.arange(constrained)
        started = time.perf_counter()
        for _ in range(repeats):
            logits.index_put_((index,), runner.grammar_mask(None, logits[index], bitmask[index]))
        return 1e3 * (time.perf_counter() - started) / repeats
    if device == "xla":
        import torch_xla

        dev = torch_xla.device()
        logits, bitmask, flags = logits.to(dev), bitmask.to(dev), flags.to(dev)
        sync = torch_xla.sync
        apply_grammar_bitmask(logits, bitmask, flags).cpu()  # compile once
    started = time.perf_counter()
    for _ in range(repeats):
        out = apply_grammar_bitmask(logits, bitmask, flags)
        if sync is not None:
            sync()
    out.cpu()
    return 1e3 * (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--constrained", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=str(REPO_ROOT / "bench/results/structured.json"))
    args = parser.parse_args()
    if not 0 < args.constrained <= args.batch:
        parser.error("--constrained must be in [1, --batch]")

    from meshserve import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch,
              max_model_len=1024)
    run_batch(llm, args.batch, args.constrained, 4)  # compile the grammar, warm the caches
    free = run_batch(llm, args.batch, 0, args.steps)
    mixed = run_batch(llm, args.batch, args.constrained, args.steps)
    device = device_mask_ms(args.batch, args.constrained, llm.engine.loaded.config.vocab_size,
                            args.device, llm.engine.runner)
    masks = mixed["host_ms"] + device
    result: dict[str, Any] = {
        "machine": machine_info(),
        "settings": vars(args),
        "free_step_ms": round(free["step_ms"], 3),
        "mixed_step_ms": round(mixed["step_ms"], 3),
        "host_grammar_ms_per_step": round(mixed["host_ms"], 3),
        "device_mask_ms_per_step": round(device, 3),
        "masks_ms_per_step": round(masks, 3),
        "masks_share_of_free_step": round(masks / free["step_ms"], 4),
        "step_difference_ms": round(mixed["step_ms"] - free["step_ms"], 3),
        "steps_measured": [free["steps"], mixed["steps"]],
        "target_share": 0.05,
    }
    output = Path(args.output)
    write_json(output, result)
    bar_chart(output.with_suffix(".png"), ["ms per step"],
              {"decode step": [free["step_ms"]], "host grammar": [mixed["host_ms"]],
               "device mask": [device]},
              title=f"structured output: {args.constrained} of {args.batch} constrained "
                    f"({args.device}, {args.dtype})", ylabel="ms")
    print(f"decode step (no constraint) {free['step_ms']:.2f} ms; with {args.constrained} "
          f"constrained {mixed['step_ms']:.2f} ms")
    print(f"masks per step: host {mixed['host_ms']:.3f} ms + device {device:.3f} ms = "
          f"{masks:.3f} ms = {100 * masks / free['step_ms']:.2f}% of a decode step (target < 5%)")


if __name__ == "__main__":
    main()
