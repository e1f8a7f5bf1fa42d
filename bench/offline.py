"""Offline throughput: meshserve's ``LLM.generate`` against transformers' ``generate()``.

Runs N prompts x M output tokens (greedy, ignore_eos) on the bundled SmolLM2-135M-Instruct in each
requested dtype and reports output tokens/s for both engines, measured in the same run, with the
peak RSS of each. Every (engine, dtype) pair runs in its own subprocess, so peak RSS figures are
separate and memory is returned between phases. On a machine without an accelerator these are CPU
figures.

    .venv/bin/python bench/offline.py [--dtypes bfloat16,float32] [--num-prompts 32]
        [--max-tokens 64] [--skip-transformers] [--device cpu] [--output bench/results/offline.json]
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

from common import REPO_ROOT, bar_chart, machine_info, memory_mib, write_json

ENGINES = ("meshserve", "transformers")

_SUBJECTS = [
    "the water cycle", "how a bicycle gear works", "the history of the printing press",
    "why the sky is blue", "how vaccines train the immune system", "the rules of chess",
    "how a compiler turns source code into machine code", "the causes of the French Revolution",
    "photosynthesis in green plants", "how bread rises", "the life cycle of a star",
    "how a refrigerator keeps food cold", "the basics of supply and demand", "how bees make honey",
    "what a black hole is", "how the internet routes a message",
]
_TASKS = [
    "Explain {s} in simple terms, one step at a time.",
    "Write a short paragraph about {s} for a curious ten-year-old.",
    "Give three key facts about {s}, each in one sentence.",
    "Describe {s} as if you were a museum guide speaking to visitors.",
]
_CONTEXT = [
    "The reader is a student preparing for an exam next week and wants a clear overview.",
    "Keep the tone friendly, avoid jargon, and define any technical term you use.",
    "Start with a one-sentence summary, then give the details in a logical order.",
    "Where it helps, use an everyday comparison that makes the idea easy to picture.",
    "Mention one common misconception and explain why it is wrong.",
    "Finish with a question the reader could explore on their own afterwards.",
    "It will be read aloud, so prefer short sentences.",
]


def build_prompts(n: int) -> list[str]:
    """Return ``n`` deterministic English prompts of about 10 to 120 tokens.

    Prompt i asks one of four tasks about one of sixteen subjects and prepends ``i % 8`` context
    sentences, so lengths vary steadily across the batch.
    """
    prompts = []
    for i in range(n):
        task = _TASKS[i % len(_TASKS)].format(s=_SUBJECTS[(i * 5) % len(_SUBJECTS)])
        context = [_CONTEXT[(i + j) % len(_CONTEXT)] for j in range(i % 8)]
        prompts.append(" ".join(context + [task]))
    return prompts


def run_meshserve(dtype: str, device: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Build ``LLM`` once, warm it up, and time one ``generate`` over all prompts."""
    from meshserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=None, dtype=dtype, device=device, max_num_seqs=64, max_num_batched_tokens=1024)
    load_s = time.perf_counter() - start
    memory = {"after_load": memory_mib()}
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    memory["after_warmup"] = memory_mib()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    memory["after_generate"] = memory_mib()
    return {
        "load_s": load_s, "elapsed_s": elapsed, "memory": memory,
        "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


def run_transformers(dtype: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Load the same GGUF with transformers and time one left-padded batched ``generate()``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from meshserve.runner.loader import default_model_path

    hf_logging.disable_progress_bar()
    folder, name = os.path.split(default_model_path())
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                 dtype=getattr(torch, dtype))
    model.eval()
    load_s = time.perf_counter() - start
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    memory = {"after_load": memory_mib()}

    def generate(batch: list[str], new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = tokenizer(batch, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
        return inputs["attention_mask"], out[:, inputs["input_ids"].shape[1]:]

    generate(prompts[:4], 8)
    memory["after_warmup"] = memory_mib()
    start = time.perf_counter()
    mask, new = generate(prompts, max_tokens)
    elapsed = time.perf_counter() - start
    memory["after_generate"] = memory_mib()
    return {
        "load_s": load_s, "elapsed_s": elapsed, "memory": memory,
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": mask.sum(dim=1).tolist(),
        "output_token_ids": new.tolist(),
    }


def run_worker(engine: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one (engine, dtype) pair in a fresh interpreter and return its raw JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine,
               "--dtypes", dtype, "--num-prompts", str(args.num_prompts),
               "--max-tokens", str(args.max_tokens), "--device", args.device,
               "--output", str(result_path)]
        subprocess.run(cmd, check=True, cwd=REPO_ROOT)
        return json.loads(result_path.read_text(encoding="utf-8"))


def summarize(raw: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Reduce a worker's raw result to throughput, token-count checks and memory."""
    counts = [len(ids) for ids in raw["output_token_ids"]]
    total = sum(counts)
    return {
        "output_tokens": total,
        "all_outputs_full_length": all(c == max_tokens for c in counts),
        "elapsed_s": round(raw["elapsed_s"], 3),
        "output_tokens_per_s": round(total / raw["elapsed_s"], 1),
        "load_s": round(raw["load_s"], 2),
        "peak_rss_mib": raw["memory"]["after_generate"]["peak_rss_mib"],
        "memory": raw["memory"],
        **({"torch_threads": raw["torch_threads"]} if "torch_threads" in raw else {}),
    }


def agreement(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Compare the two engines' greedy tokens prompt by prompt."""
    pairs = list(zip(ours["output_token_ids"], theirs["output_token_ids"]))
    prefixes = []
    for a, b in pairs:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    return {
        "identical_fraction": round(sum(a == b for a, b in pairs) / len(pairs), 3),
        "mean_common_prefix_tokens": round(sum(prefixes) / len(prefixes), 1),
        "same_prompt_tokens": ours["prompt_tokens"] == theirs["prompt_tokens"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``--dtypes`` becomes a list."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="comma-separated: bfloat16, float32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--device", default="cpu", help="meshserve's device (transformers: cpu)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/offline.json")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    return args


def print_table(results: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Print one line per (dtype, engine), then agreement and speed-up per dtype."""
    load = info["load_average_1_5_15min"]
    print(f"\nOffline throughput, CPU ({info['cpu_count']} cores, {info['cpu_model']}); "
          f"1-min load average {load['before'][0]} before, {load['after'][0]} after")
    print(f"{'dtype':<10}{'engine':<14}{'tok/s':>9}{'time s':>9}{'peak RSS MiB':>14}"
          f"{'full len':>10}")
    for dtype, row in results.items():
        for engine in ENGINES:
            if engine in row:
                r = row[engine]
                print(f"{dtype:<10}{engine:<14}{r['output_tokens_per_s']:>9.1f}"
                      f"{r['elapsed_s']:>9.2f}{r['peak_rss_mib']:>14.0f}"
                      f"{str(r['all_outputs_full_length']):>10}")
        if "agreement" in row:
            a = row["agreement"]
            print(f"{'':<10}greedy agreement: {a['identical_fraction']:.0%} of prompts identical, "
                  f"mean common prefix {a['mean_common_prefix_tokens']} tokens")
        if "speedup_vs_transformers" in row:
            print(f"{'':<10}meshserve / transformers: {row['speedup_vs_transformers']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    """Run as the coordinator (default) or as one ``--worker`` subprocess."""
    args = parse_args(argv)
    prompts = build_prompts(args.num_prompts)
    if args.worker:
        if args.worker == "meshserve":
            raw = run_meshserve(args.dtypes[0], args.device, prompts, args.max_tokens)
        else:
            raw = run_transformers(args.dtypes[0], prompts, args.max_tokens)
        write_json(args.output, raw)
        return

    info = machine_info()
    load_before = os.getloadavg()
    engines = ENGINES[:1] if args.skip_transformers else ENGINES
    results: dict[str, dict[str, Any]] = {}
    prompt_tokens: list[int] = []
    for dtype in args.dtypes:
        raw = {}
        for engine in engines:
            print(f"[offline] {engine} {dtype} ...", file=sys.stderr, flush=True)
            raw[engine] = run_worker(engine, dtype, args)
        prompt_tokens = raw["meshserve"]["prompt_tokens"]
        row: dict[str, Any] = {e: summarize(r, args.max_tokens) for e, r in raw.items()}
        if "transformers" in raw:
            row["agreement"] = agreement(raw["meshserve"], raw["transformers"])
            row["speedup_vs_transformers"] = round(
                row["meshserve"]["output_tokens_per_s"]
                / row["transformers"]["output_tokens_per_s"], 2)
        results[dtype] = row

    info["load_average_1_5_15min"] = {"before": [round(x, 2) for x in load_before],
                                      "after": [round(x, 2) for x in os.getloadavg()]}
    write_json(args.output, {
        "benchmark": "offline", "hardware": "CPU", "machine": info,
        "settings": {"model": "SmolLM2-135M-Instruct (bundled GGUF)", "device": args.device,
                     "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "greedy": True, "ignore_eos": True,
                     "prompt_tokens": prompt_tokens},
        "results": results,
    })
    bar_chart(args.output.with_suffix(".png"), list(results),
              {e: [results[d].get(e, {}).get("output_tokens_per_s") for d in results]
               for e in engines},
              title=f"Offline output tokens/s, CPU ({info['cpu_count']} cores): "
                    f"{args.num_prompts} prompts x {args.max_tokens} tokens, SmolLM2-135M",
              ylabel="output tokens/s (CPU)")
    print_table(results, info)
    print(f"\nwrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
