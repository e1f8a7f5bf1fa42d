"""One timed burst of an offline engine, and a worker loop that runs bursts on request.

A burst is one ``generate`` over a list of prompts; it is timed in wall seconds and in the CPU
seconds of the whole process and its children (every thread: the engine's OpenMP team included;
the child process vLLM's engine core runs in). ``serve`` runs a long-lived engine in a worker
process: one JSON list of prompts per stdin line in, one JSON result per stdout line out. Standard
library only (and ``process_cpu``, which is too): the vLLM peer's venv (``vllm_worker.py``)
imports it.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Callable

from process_cpu import parse_stat

READY = "ready"  # the worker's first line, once its engine has loaded and warmed up

Generate = Callable[[list[str]], int]  # runs the prompts to completion; returns output tokens


def tree_cpu_s() -> float:
    """User + system seconds of this process and every live descendant (Linux's /proc; this
    process's alone elsewhere)."""
    if not os.path.isdir("/proc/self/task"):
        return time.process_time()
    total, pending = 0.0, [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                total += parse_stat(f.read())[1]
            for children in glob.glob(f"/proc/{pid}/task/*/children"):
                with open(children, encoding="ascii") as f:
                    pending.extend(int(child) for child in f.read().split())
        except OSError:  # it exited meanwhile
            continue
    return total


def timed(generate: Generate, prompts: list[str]) -> dict[str, float]:
    start, cpu_start = time.perf_counter(), tree_cpu_s()
    tokens = generate(prompts)
    elapsed, cpu = time.perf_counter() - start, tree_cpu_s() - cpu_start
    return {"output_tokens": tokens, "elapsed_s": round(elapsed, 3),
            "output_throughput": round(tokens / elapsed, 1), "cpu_s": round(cpu, 2)}


def serve(generate: Generate) -> None:
    """Answer bursts until stdin closes (call once the engine is warm)."""
    print(READY, flush=True)
    for line in sys.stdin:
        print(json.dumps(timed(generate, json.loads(line))), flush=True)
