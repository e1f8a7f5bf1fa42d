"""``meshserve bench serve``: the subcommand's flags, and its handler.

Registering the flags imports nothing heavy; httpx and the client load only when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench serve`` on a CLI; the handler is ``args.func(args) -> int``."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser(
        "serve", help="latency and throughput of an OpenAI-compatible server",
        description="Benchmark /v1/completions on any OpenAI-compatible server (meshserve, vLLM).")
    serve.add_argument("--url", required=True, help="server root, e.g. http://localhost:8000")
    serve.add_argument("--model", required=True, help="model name the server expects")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    serve.add_argument("--stream", action="store_true",
                       help="stream responses, which times the first token apart from the end")
    serve.add_argument("--max-tokens", type=int, default=64,
                       help="output tokens per request (EOS ignored where the server allows)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    serve.add_argument("--prompt-words", type=int, nargs=2, default=(16, 256),
                       metavar=("MIN", "MAX"), help="synthetic prompt lengths, in words")
    serve.add_argument("--dataset", help='JSON lines file of {"prompt": ...} instead')
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer token (default: $OPENAI_API_KEY)")
    serve.add_argument("--timeout", type=float, default=300.0,
                       help="seconds for the whole run (default 300)")
    serve.add_argument("--output", default="bench/results/serve.json",
                       help="JSON path; the plot goes beside it with a .png suffix")
    serve.set_defaults(func=_run_serve)
    return serve


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from meshserve.benchmark.client import run_benchmark
    from meshserve.benchmark.report import format_table, write_report
    from meshserve.benchmark.results import BenchConfig

    try:
        config = BenchConfig(
            url=args.url, model=args.model, num_prompts=args.num_prompts,
            concurrency=args.concurrency, stream=args.stream, max_tokens=args.max_tokens,
            seed=args.seed, api_key=args.api_key, timeout=args.timeout, dataset=args.dataset,
            prompt_words=tuple(args.prompt_words))
        result = asyncio.run(run_benchmark(config))
    except (ValueError, OSError) as error:  # bad flags or an unreadable dataset
        print(f"meshserve bench serve: error: {error}", file=sys.stderr)
        return 2
    print(format_table(result))
    json_path, png_path = write_report(result, args.output)
    print(f"wrote {json_path} and {png_path}")
    return 0 if len(result.completed) == len(result.requests) else 1
