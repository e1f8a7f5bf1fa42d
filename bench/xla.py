"""device="xla" on torch_xla's PJRT CPU client next to the eager cpu backend.

For each variant (the cpu backend, then XLA:CPU at each requested tensor-parallel size) it reports
the start-up time (load, KV cache, warm-up), the warm-up's own time and compiled-graph count, and
the steady-state output tokens/s of the offline benchmark's prompts (greedy, EOS ignored), after a
short untimed generate. It also checks that serving compiled no graph after warm-up and compares
the greedy tokens with the cpu backend's. Each variant runs in its own subprocess, with
``CPU_NUM_DEVICES`` set to its tensor-parallel size.

These are CPU figures: XLA:CPU runs the padded attention formulation and compiles for a CPU. They
say nothing about a TPU, where the Pallas kernel and the MXU change everything.

    .venv/bin/python bench/xla.py [--num-prompts 32] [--max-tokens 64] [--tensor-parallel 1]
        [--output bench/results/xla.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO_ROOT, machine_info, memory_mib, write_json
from offline import build_prompts

# One shape budget for both backends; max_model_len bounds the padded attention's context.
ENGINE = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, max_model_len=256,
              num_kv_blocks=32 * 16 + 1)


def run_variant(device: str, tp: int, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Build the engine (timed), warm it with a short generate, then time the whole batch."""
    from meshserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(None, device=device, tensor_parallel_size=tp, **ENGINE)
    startup_s = time.perf_counter() - start
    runner = llm.engine.runner
    graphs_ready = runner.backend.num_compiled_graphs()
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    report = runner.warm_up_report
    return {
        "startup_s": startup_s,
        "warm_up_s": None if report is None else report.seconds,
        "warm_up_programs": None if report is None else report.programs,
        "compiled_graphs": graphs_ready,
        "graphs_compiled_while_serving": runner.backend.num_compiled_graphs() - graphs_ready,
        "elapsed_s": elapsed,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "memory": memory_mib(),
    }


def run_worker(device: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(tp), TF_CPP_MIN_LOG_LEVEL="2")
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", device,
                        "--tensor-parallel", str(tp), "--num-prompts", str(args.num_prompts),
                        "--max-tokens", str(args.max_tokens), "--output", str(result)],
                       check=True, cwd=REPO_ROOT, env=env)
        return json.loads(result.read_text(encoding="utf-8"))


def summarize(raw: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    tokens = sum(len(ids) for ids in raw["output_token_ids"])
    pairs = list(zip(raw["output_token_ids"], reference["output_token_ids"]))
    return {
        "output_tokens_per_s": round(tokens / raw["elapsed_s"], 1),
        "elapsed_s": round(raw["elapsed_s"], 2),
        "startup_s": round(raw["startup_s"], 1),
        "warm_up_s": None if raw["warm_up_s"] is None else round(raw["warm_up_s"], 1),
        "warm_up_pieces": raw["warm_up_pieces"],
        "compiled_graphs": raw["compiled_graphs"],
        "graphs_compiled_while_serving": raw["graphs_compiled_while_serving"],
        "greedy_identical_to_cpu": round(sum(a == b for a, b in pairs) / len(pairs), 3),
        "rss_mib": raw["memory"]["rss_mib"],
    }


def plot(path: Path, results: dict[str, dict[str, Any]], cores: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (speed, start) = plt.subplots(1, 2, figsize=(9, 4))
    bars = speed.bar(names, [r["output_tokens_per_s"] for r in results.values()])
    speed.bar_label(bars, fmt="%.0f", fontsize=8)
    speed.set_ylabel("output tokens/s (steady state)")
    warm = [r["warm_up_s"] or 0.0 for r in results.values()]
    rest = [r["startup_s"] - w for r, w in zip(results.values(), warm)]
    start.bar(names, rest, label="load + KV cache")
    bars = start.bar(names, warm, bottom=rest, label="warm-up (compile)")
    start.bar_label(bars, labels=[f"{r['compiled_graphs']} graphs" if r["warm_up_s"] else ""
                                  for r in results.values()], fontsize=8)
    start.set_ylabel("start-up s")
    start.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M fp32, CPU figures ({cores} cores; XLA:CPU = torch_xla PJRT CPU "
                 "client), not TPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tensor-parallel", default="1",
                        help="comma-separated XLA tensor-parallel sizes (SmolLM2: 1, 3 or 9)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/xla.json")
    parser.add_argument("--worker", choices=("cpu", "xla"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = [int(s) for s in args.tensor_parallel.split(",")]
    prompts = build_prompts(args.num_prompts)
    if args.worker:
        write_json(args.output, run_variant(args.worker, sizes[0], prompts, args.max_tokens))
        return
    info, load_before = machine_info(), os.getloadavg()
    raw = {"cpu": run_worker("cpu", 1, args)}
    for tp in sizes:
        print(f"[xla] XLA:CPU tensor_parallel_size={tp} ...", file=sys.stderr, flush=True)
        raw[f"xla tp={tp}"] = run_worker("xla", tp, args)
    results = {name: summarize(r, raw["cpu"]) for name, r in raw.items()}
    info["load_average_1_5_15min"] = {"before": [round(x, 2) for x in load_before],
                                      "after": [round(x, 2) for x in os.getloadavg()]}
    write_json(args.output, {
        "benchmark": "xla", "hardware": "CPU", "machine": info,
        "settings": {"model": "SmolLM2-135M-Instruct (bundled GGUF)", **ENGINE,
                     "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "greedy": True, "ignore_eos": True},
        "results": results,
    })
    plot(args.output.with_suffix(".png"), results, info["cpu_count"])
    print(f"\nXLA:CPU next to the cpu backend, CPU figures ({info['cpu_count']} cores)")
    print(f"{'variant':<10}{'tok/s':>8}{'start-up s':>12}{'warm-up s':>11}{'graphs':>8}"
          f"{'new while serving':>19}{'same greedy':>13}")
    for name, r in results.items():
        print(f"{name:<10}{r['output_tokens_per_s']:>8.1f}{r['startup_s']:>12.1f}"
              f"{r['warm_up_s'] or 0:>11.1f}{r['compiled_graphs']:>8}"
              f"{r['graphs_compiled_while_serving']:>19}{r['greedy_identical_to_cpu']:>13.0%}")


if __name__ == "__main__":
    main()
