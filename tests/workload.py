"""A randomized workload for "nothing compiles after warm-up" checks, on either backend.

Mixed prompt lengths (chunked prefill under a small token budget), greedy and sampled requests
with every filter and penalty, seeded and not, logprobs and prompt logprobs on and off, arrivals
while others run, an abort, and few enough KV blocks that some requests are preempted.
"""

from __future__ import annotations

import numpy as np

from meshserve import SamplingParams


def compile_counters() -> dict[str, int]:
    """dynamo's frame and graph counts and inductor's: any compilation or re-trace moves them."""
    from torch._dynamo.utils import counters

    return {f"{kind} {name}": count for kind in ("frames", "stats", "inductor")
            for name, count in counters[kind].items()}


def random_request(rng: np.random.Generator, index: int) -> tuple:
    length = int(rng.integers(1, 200))
    params = SamplingParams(
        temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, 0, 5, 50])),
        top_p=float(rng.choice([1.0, 1.0, 0.9])), min_p=float(rng.choice([0.0, 0.1])),
        presence_penalty=float(rng.choice([0.0, 0.5])),
        repetition_penalty=float(rng.choice([1.0, 1.2])),
        seed=None if rng.random() < 0.5 else index,
        logprobs=[None, None, 0, 3, 20][int(rng.integers(5))],
        prompt_logprobs=[None, None, None, 2][int(rng.integers(4))],
        max_tokens=int(rng.integers(2, 24)), ignore_eos=True)
    return (f"r{index}", rng.integers(100, 40000, size=length).tolist(), params)


def run_random_workload(engine, seed: int, requests: int = 24) -> dict[str, int]:
    """Drive ``engine`` (an EngineCore) through the workload; returns steps and preemptions."""
    rng = np.random.default_rng(seed)
    waiting = [random_request(rng, i) for i in range(requests)]
    steps = 0
    while waiting or engine.has_unfinished:
        if waiting and (not engine.has_unfinished or rng.random() < 0.4):
            for _ in range(int(rng.integers(1, 4))):  # arrivals while others run
                if waiting:
                    engine.add_request(*waiting.pop())
        if steps == 5:
            engine.add_request("dropped", list(range(500, 560)), SamplingParams(max_tokens=50))
        if steps == 9:
            engine.abort("dropped")
        engine.step()
        steps += 1
    return {"steps": steps, "preemptions": engine.scheduler.num_preemptions}
