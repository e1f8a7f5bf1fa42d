"""What one step costs the host, compiled against eager, and what warm-up costs, cold and cached.

Three measurements, each variant in its own subprocess:

1. **Decode step, narrow model.** A 30-layer Llama with hidden size 64 (random weights, built
   here), so the device's arithmetic is negligible and a step's time is the host's: 32 sequences
   decoding, the median of 40 steps, for eager torch (``device="cpu", enforce_eager=True``), the
   compiled cpu step, and the xla step compiled (dispatched without tracing) and lazily traced
   (``enforce_eager=True``, what every xla step did before the compiled step).
2. **Decode step, SmolLM2.** The same on the bundled model: total ms per step and the host's
   share (the step minus its model pieces).
3. **Warm-up.** The default server engine (bundled model, default settings) on cpu and on xla,
   started twice with the same fresh ``compile_cache_dir``: cold, then from the cache.

These are CPU figures (xla = torch_xla's PJRT CPU client), not TPU figures.

    .venv/bin/python bench/step.py [--steps 40] [--models narrow,smollm2]
                                   [--warm-up-devices cpu,xla]
                                   [--output bench/results/step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO_ROOT, bar_chart, machine_info, time_model_pieces, write_json

VARIANTS = {  # name: (device, enforce_eager)
    "cpu eager": ("cpu", True),
    "cpu compiled": ("cpu", False),
    "xla compiled": ("xla", False),
    "xla lazy": ("xla", True),
}
SEQUENCES = 32


def build_narrow_model(folder: Path) -> str:
    import torch
    import transformers

    from meshserve.runner.loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def time_decode_steps(model: str | None, device: str, eager: bool, steps: int) -> dict[str, Any]:
    """Prefill 32 sequences, then time decode steps one by one (each step: schedule, run,
    apply); the model's pieces are timed apart so the host's share is known."""
    from meshserve import LLM, SamplingParams

    llm = LLM(model, device=device, enforce_eager=eager, dtype="float32", max_num_seqs=SEQUENCES,
              max_num_batched_tokens=512, max_model_len=512, num_kv_blocks=SEQUENCES * 32 + 1)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(SEQUENCES):
        engine.add_request(str(i), list(range(100 + i, 116 + i)), params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids)
              for r in engine.scheduler.requests.values()):
        engine.step()  # prefill
    pieces = time_model_pieces(runner)
    totals = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
    host = [t - p for t, p in zip(totals, pieces)]
    return {"step_ms": 1e3 * statistics.median(totals), "host_ms": 1e3 * statistics.median(host),
            "steps": steps}


def time_warm_up(device: str, cache_dir: str) -> dict[str, Any]:
    from meshserve import LLM

    from torch._dynamo.utils import counters

    start = time.perf_counter()
    llm = LLM(None, device=device, compile_cache_dir=cache_dir)
    report = llm.engine.runner.warm_up_report
    # inductor's FX graph cache: a cached start on cpu must miss nothing (nothing compiled anew).
    inductor = counters["inductor"]
    return {"startup_s": time.perf_counter() - start, "warm_up_s": report.seconds,
            "programs": report.programs, "fxgraph_cache_hits": inductor["fxgraph_cache_hit"],
            "fxgraph_cache_misses": inductor["fxgraph_cache_miss"]}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    if job["kind"] == "decode":
        return time_decode_steps(job["model"], job["device"], job["eager"], job["steps"])
    return time_warm_up(job["device"], job["cache_dir"])


def run(job: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"],
                          input=json.dumps(job), capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--models", default="narrow,smollm2",
                        help="models whose decode step is timed: narrow, smollm2 or both")
    parser.add_argument("--warm-up-devices", default="cpu,xla",
                        help="devices whose default-server warm-up is timed (empty: none)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/step.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(sys.stdin.read()))))
        return
    info, load_before = machine_info(), os.getloadavg()
    models = [m for m in ("narrow", "smollm2") if m in args.models.split(",")]
    results: dict[str, Any] = {**{m: {} for m in models}, "warm_up": {}}

    def save() -> None:
        # After every measurement, so a run cut short keeps what it measured.
        info["load_average_1_5_15min"] = {"before": [round(x, 2) for x in load_before],
                                          "after": [round(x, 2) for x in os.getloadavg()]}
        write_json(args.output, {"benchmark": "step", "hardware": "CPU", "machine": info,
                                 "settings": {"sequences": SEQUENCES, "steps": args.steps},
                                 "results": results})

    with tempfile.TemporaryDirectory() as tmp:
        narrow = build_narrow_model(Path(tmp) / "narrow-llama")
        for name, (device, eager) in VARIANTS.items():
            for model, key in ((narrow, "narrow"), (None, "smollm2")):
                if key not in models:
                    continue
                print(f"[step] {key} {name} ...", file=sys.stderr, flush=True)
                results[key][name] = run({"kind": "decode", "model": model, "device": device,
                                          "eager": eager, "steps": args.steps})
                save()
        for device in filter(None, args.warm_up_devices.split(",")):
            cache = str(Path(tmp) / f"cache-{device}")
            results["warm_up"][device] = {}
            for phase in ("cold", "cached"):
                print(f"[step] warm-up {device} {phase} ...", file=sys.stderr, flush=True)
                results["warm_up"][device][phase] = run(
                    {"kind": "warm_up", "device": device, "cache_dir": cache})
                save()
    bar_chart(args.output.with_suffix(".png"), list(VARIANTS),
              {key: [results[key][v]["step_ms"] for v in VARIANTS]
               for key in models},
              title=f"Decode step of {SEQUENCES} sequences, ms (CPU, {info['cpu_count']} cores, "
                    f"{info['cpu_model']}; xla = PJRT CPU)",
              ylabel="ms per step (median)")
    print(f"\nDecode step of {SEQUENCES} sequences, CPU figures ({info['cpu_model']})")
    for key in models:
        for name, r in results[key].items():
            print(f"{key:<8}{name:<14}{r['step_ms']:>9.2f} ms/step{r['host_ms']:>9.2f} ms host")
    for device, phases in results["warm_up"].items():
        for phase, r in phases.items():
            print(f"warm-up {device:<4}{phase:<8}{r['warm_up_s']:>8.1f} s warm-up, "
                  f"{r['startup_s']:.1f} s start-up, {r['programs']} programs, inductor cache "
                  f"{r['fxgraph_cache_hits']} hits / {r['fxgraph_cache_misses']} misses")
    print(f"\nwrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
