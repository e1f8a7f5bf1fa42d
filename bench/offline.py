"""Offline throughput: meshserve's ``LLM.generate`` against transformers' ``generate()`` and,
with ``--peer-python``, vLLM's CPU build, all in the same run.

Runs N prompts x M output tokens (greedy, ignore_eos) on the bundled SmolLM2-135M-Instruct in each
requested dtype (default: the CPU's native dtype, plus float32 where that is bfloat16) and reports
output tokens/s per engine with the peak RSS of each, meshserve's host milliseconds per step
(everything but the model's own pieces: scheduling, input layout, collection, detokenization), and
each engine's share of the compute ceiling (the workload's matmul FLOPs over the peak GEMM rate
this machine reaches in that dtype, measured here). Every (engine, dtype) pair runs in its own
subprocess. On a machine without an accelerator these are CPU figures.

    .venv/bin/python bench/offline.py [--dtypes auto|bfloat16,float32] [--num-prompts 32]
        [--max-tokens 64] [--skip-transformers] [--device cpu]
        [--peer-python ~/vllm-peer/bin/python [--peer-model DIR]]
        [--output bench/results/offline.json]
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

from common import REPO_ROOT, bar_chart, machine_info, memory_mib, time_model_pieces, write_json

ENGINES = ("meshserve", "transformers", "vllm")

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
    """Build ``LLM`` once, warm it up, and time one ``generate`` over all prompts, timing the
    runner's model pieces apart from the rest of each step."""
    from meshserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=None, dtype=dtype, device=device, max_num_seqs=64, max_num_batched_tokens=1024)
    load_s = time.perf_counter() - start
    memory = {"after_load": memory_mib()}
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    memory["after_warmup"] = memory_mib()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps = time_model_pieces(llm.engine.runner)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    memory["after_generate"] = memory_mib()
    return {
        "load_s": load_s, "elapsed_s": elapsed, "memory": memory,
        "steps": len(steps), "device_s": sum(steps),
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
        if engine == "vllm":
            prompts_path = Path(tmp) / "prompts.json"
            prompts_path.write_text(json.dumps(build_prompts(args.num_prompts)), encoding="utf-8")
            cmd = [args.peer_python, str(Path(__file__).with_name("vllm_worker.py")),
                   "--model", str(args.peer_model), "--dtype", dtype,
                   "--prompts", str(prompts_path), "--max-tokens", str(args.max_tokens),
                   "--output", str(result_path)]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine,
                   "--dtypes", dtype, "--num-prompts", str(args.num_prompts),
                   "--max-tokens", str(args.max_tokens), "--device", args.device,
                   "--output", str(result_path)]
        subprocess.run(cmd, check=True, cwd=REPO_ROOT)
        return json.loads(result_path.read_text(encoding="utf-8"))


def export_hf_folder(folder: Path) -> None:
    """Write the bundled GGUF as a Hugging Face folder (fp32 safetensors) for the vLLM peer,
    which cannot read it; transformers dequantizes it, as meshserve's loader does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshserve.runner.loader import default_model_path

    source, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)
    # transformers keeps a GGUF quantizer on the model (every weight is dense fp32 by now) and
    # refuses to save while it is there.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(source, gguf_file=name, local_files_only=True).save_pretrained(
        folder)


def workload_flop(prompt_tokens: list[int], max_tokens: int) -> float:
    """Matmul FLOPs of the workload on the bundled model: 2 x the non-embedding weights per
    computed token, the lm_head for each sampled token, and attention scores and values over
    each token's context (every layer, every query head)."""
    from meshserve.runner.loader import load_model

    config = load_model(None, progress=False).config
    h, layers, heads, d = (config.hidden_size, config.num_hidden_layers,
                           config.num_attention_heads, config.head_dim)
    kv = config.num_key_value_heads * d
    per_layer = h * (heads * d + 2 * kv) + heads * d * h + 3 * h * config.intermediate_size
    flop = 0.0
    for prompt in prompt_tokens:
        for position in range(prompt + max_tokens):
            flop += 2 * layers * per_layer + 4 * layers * heads * d * (position + 1)
        flop += 2 * h * config.vocab_size * max_tokens  # one sampled token per output token
    return flop


def peak_gflops(dtype: str) -> float:
    """The best GEMM rate torch reaches here in ``dtype`` with every core (large square
    matmuls): the ceiling the engines' shares are taken against."""
    import torch

    a = torch.randn(2048, 2048).to(getattr(torch, dtype))
    b = torch.randn(2048, 2048).to(getattr(torch, dtype))
    best = 0.0
    for _ in range(8):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * 2048 ** 3 / (time.perf_counter() - start) / 1e9)
    return best


def native_dtypes() -> list[str]:
    from meshserve.spmd.backend import native_bf16_flags

    return ["bfloat16", "float32"] if native_bf16_flags() else ["float32"]


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
        **({"vllm_version": raw["vllm_version"]} if "vllm_version" in raw else {}),
        **({"steps": raw["steps"],
            "host_ms_per_step": round(1e3 * (raw["elapsed_s"] - raw["device_s"]) / raw["steps"],
                                      2),
            "device_ms_per_step": round(1e3 * raw["device_s"] / raw["steps"], 2)}
           if raw.get("steps") else {}),
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
    parser.add_argument("--dtypes", default="auto",
                        help="comma-separated: bfloat16, float32; auto: the CPU's native dtype "
                             "(and float32 too where that is bfloat16)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--device", default="cpu", help="meshserve's device (transformers: cpu)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/offline.json")
    parser.add_argument("--peer-python", default=None,
                        help="the python of a venv with vLLM's CPU build: run it as a peer")
    parser.add_argument("--peer-model", type=Path, default=REPO_ROOT / "bench/results/smollm2-hf",
                        help="Hugging Face folder of the bundled model for the peer (written "
                             "from the GGUF when missing)")
    parser.add_argument("--worker", choices=ENGINES[:2], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dtypes == "auto" and not args.worker:
        args.dtypes = ",".join(native_dtypes())
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    return args


def print_table(results: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Print one line per (dtype, engine), then agreement and speed-up per dtype."""
    load = info["load_average_1_5_15min"]
    print(f"\nOffline throughput, CPU ({info['cpu_count']} cores, {info['cpu_model']}); "
          f"1-min load average {load['before'][0]} before, {load['after'][0]} after")
    print(f"{'dtype':<10}{'engine':<14}{'tok/s':>9}{'time s':>9}{'ceiling':>9}"
          f"{'peak RSS MiB':>14}{'full len':>10}")
    for dtype, row in results.items():
        for engine in ENGINES:
            if engine in row:
                r = row[engine]
                print(f"{dtype:<10}{engine:<14}{r['output_tokens_per_s']:>9.1f}"
                      f"{r['elapsed_s']:>9.2f}{r['share_of_ceiling']:>9.0%}"
                      f"{r['peak_rss_mib']:>14.0f}{str(r['all_outputs_full_length']):>10}")
        m = row["meshserve"]
        print(f"{'':<10}meshserve per step: {m['host_ms_per_step']} ms host, "
              f"{m['device_ms_per_step']} ms in the model's pieces ({m['steps']} steps); "
              f"ceiling {row['ceiling_tokens_per_s']} tok/s at {row['peak_gflops']} GFLOPS")
        for peer in ENGINES[1:]:
            if f"agreement_{peer}" in row:
                a = row[f"agreement_{peer}"]
                print(f"{'':<10}greedy agreement with {peer}: {a['identical_fraction']:.0%} of "
                      f"prompts identical, mean common prefix {a['mean_common_prefix_tokens']}")
            if f"speedup_vs_{peer}" in row:
                print(f"{'':<10}meshserve / {peer}: {row[f'speedup_vs_{peer}']:.2f}x")


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
    engines = [e for e in ENGINES if not (e == "transformers" and args.skip_transformers)
               and not (e == "vllm" and args.peer_python is None)]
    if "vllm" in engines and not (args.peer_model / "config.json").exists():
        print(f"[offline] writing {args.peer_model} for the vLLM peer ...", file=sys.stderr)
        export_hf_folder(args.peer_model)
    results: dict[str, dict[str, Any]] = {}
    prompt_tokens: list[int] = []
    for dtype in args.dtypes:
        raw = {}
        for engine in engines:
            print(f"[offline] {engine} {dtype} ...", file=sys.stderr, flush=True)
            raw[engine] = run_worker(engine, dtype, args)
        prompt_tokens = raw["meshserve"]["prompt_tokens"]
        row: dict[str, Any] = {e: summarize(r, args.max_tokens) for e, r in raw.items()}
        flop, peak = workload_flop(prompt_tokens, args.max_tokens), peak_gflops(dtype)
        tokens = row["meshserve"]["output_tokens"]
        row["peak_gflops"] = round(peak, 1)
        row["workload_gflop"] = round(flop / 1e9, 1)
        row["ceiling_tokens_per_s"] = round(tokens / (flop / 1e9 / peak), 1)
        for engine in raw:
            row[engine]["share_of_ceiling"] = round(
                row[engine]["output_tokens_per_s"] / row["ceiling_tokens_per_s"], 3)
        for peer in raw:
            if peer != "meshserve":
                row[f"agreement_{peer}"] = agreement(raw["meshserve"], raw[peer])
                row[f"speedup_vs_{peer}"] = round(row["meshserve"]["output_tokens_per_s"]
                                                  / row[peer]["output_tokens_per_s"], 2)
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
              title=f"Offline output tokens/s, CPU ({info['cpu_count']} cores, "
                    f"{info['cpu_model']}): {args.num_prompts} prompts x {args.max_tokens} "
                    f"tokens, SmolLM2-135M",
              ylabel="output tokens/s (CPU)")
    print_table(results, info)
    print(f"\nwrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
