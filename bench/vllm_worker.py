"""The vLLM side of ``bench/offline.py``, run by the peer's own interpreter (``--peer-python``).

vLLM's CPU build pins its own torch, so it lives in a venv of its own and cannot import meshserve
or the bench helpers; this script only needs vLLM (and, with ``--bursts``, the standard-library
``bursts.py``). It loads a Hugging Face folder, warms up with a short generate, times one greedy
generate of the prompts (EOS ignored) and writes the same raw fields as the other workers: load
and generate seconds, prompt token counts, output token ids. With ``--bursts`` it stays up
instead and times one generate per list of prompts on stdin (``bursts.serve``, for ``drift.py``).

    PEER/bin/python bench/vllm_worker.py --model DIR --dtype bfloat16 --prompts FILE.json
        --max-tokens 64 [--max-num-seqs 32] --output RESULT.json
    PEER/bin/python bench/vllm_worker.py --model DIR --dtype bfloat16 --bursts [...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

# Settings for a small shared machine, before vLLM is imported: use every core, reserve none, a
# 2 GiB KV cache, and sockets on loopback only.
CPU_SETTINGS = {
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_HOST_IP": "127.0.0.1",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder")
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--prompts", help="a JSON list of prompt strings (not with --bursts)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences in flight (default: vLLM's own)")
    parser.add_argument("--output", help="where the result goes (not with --bursts)")
    parser.add_argument("--bursts", action="store_true",
                        help="time one generate per JSON list of prompts on stdin until it closes")
    args = parser.parse_args()
    if not args.bursts and (args.prompts is None or args.output is None):
        parser.error("--prompts and --output are required without --bursts")
    for name, value in CPU_SETTINGS.items():
        os.environ.setdefault(name, value)

    import vllm

    start = time.perf_counter()
    limits = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0, **limits)
    load_s = time.perf_counter() - start
    params = vllm.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.bursts:
        from bursts import serve

        def generate(batch: list[str]) -> int:
            done = llm.generate(batch, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in done)

        generate(["Warm-up: say something about the sea."] * 4)
        serve(generate)
        return
    with open(args.prompts, encoding="utf-8") as f:
        prompts = json.load(f)
    llm.generate(prompts[:4], vllm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({
            "load_s": load_s, "elapsed_s": elapsed, "vllm_version": vllm.__version__,
            "memory": {"after_generate": {"peak_rss_mib": round(peak)}},
            "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        }, f)


if __name__ == "__main__":
    main()
