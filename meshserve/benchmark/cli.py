"""``meshserve bench serve``: the subcommand's flags, and its handler.

Registering the flags imports nothing heavy; aiohttp and the client load only when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshserve.benchmark.results import BenchConfig, Round

# Seconds before each run but the first: vLLM-CPU's worker polls a core for about a second after
# its last response, and a run started at once pays for it (bench/README.md). Harnesses that
# take turns between servers or engines use the same pause.
DEFAULT_PAUSE_S = 5.0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench serve`` on a CLI; the handler is ``args.func(args) -> int``."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser(
        "serve", help="latency and throughput of an OpenAI-compatible server",
        description="Benchmark /v1/completions on any OpenAI-compatible server (meshserve, vLLM), "
                    "or two of them back to back on the same prompts (--compare), in one round "
                    "or several (--rounds).")
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
    serve.add_argument("--compare", metavar="URL",
                       help="a peer server (e.g. vLLM's OpenAI server) to run the same workload "
                            "on right after, in the same run: one report and one chart for both")
    serve.add_argument("--compare-model",
                       help="the model name the peer expects (default: the first it lists)")
    serve.add_argument("--rounds", type=int, default=1,
                       help="run the workload this many times, on fresh prompts each round (seed, "
                            "seed + 1, ...); with --compare the server that goes first alternates, "
                            "so a machine's drift falls on both, and the ratios reported are the "
                            "medians of the rounds' (default %(default)s)")
    serve.add_argument("--pause", type=float, default=DEFAULT_PAUSE_S,
                       help="seconds to wait before each run but the first, so that work a server "
                            "still does after its run (a busy-polling worker winding down) does "
                            "not fall on the next run (default %(default)s)")
    serve.set_defaults(func=_run_serve)
    return serve


def _run_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from meshserve.benchmark.client import run, served_model
    from meshserve.benchmark.report import format_comparison, format_table, write_report
    from meshserve.benchmark.results import BenchConfig, pooled

    try:
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
        if args.pause < 0:
            raise ValueError(f"--pause must be non-negative, got {args.pause}")
        config = BenchConfig(
            url=args.url, model=args.model, num_prompts=args.num_prompts,
            concurrency=args.concurrency, stream=args.stream, max_tokens=args.max_tokens,
            seed=args.seed, api_key=args.api_key, timeout=args.timeout, dataset=args.dataset,
            prompt_words=tuple(args.prompt_words))
        peer_config = None
        if args.compare:
            peer_config = replace(config, url=args.compare, model=args.compare_model or "peer")
            if args.compare_model is None:
                peer_config = replace(peer_config, model=run(served_model(peer_config)))
        rounds = _run_rounds(config, peer_config, args.rounds, args.pause)
    except (ValueError, OSError) as error:  # bad flags, an unreadable dataset, no peer model
        print(f"meshserve bench serve: error: {error}", file=sys.stderr)
        return 2
    result = pooled([r.ours for r in rounds])
    peer = None if peer_config is None else pooled([r.peer for r in rounds])
    several = rounds if len(rounds) > 1 else ()
    print(format_table(result))
    if peer is not None:
        print(format_table(peer))
        print(format_comparison(result, peer, several))
    json_path, png_path = write_report(result, args.output, peer, several)
    print(f"wrote {json_path} and {png_path}")
    runs = [result] if peer is None else [result, peer]
    return 0 if all(len(r.completed) == len(r.requests) for r in runs) else 1


def _run_rounds(config: BenchConfig, peer_config: BenchConfig | None, num_rounds: int,
                pause: float) -> list[Round]:
    """Run ``num_rounds`` rounds, each on fresh prompts (the seed plus the round's index), with
    ``pause`` seconds before every run but the first; with a peer, both servers get the same
    prompts within a round and the first of them alternates."""
    import time
    from dataclasses import replace

    from meshserve.benchmark.client import run, run_benchmark
    from meshserve.benchmark.report import format_round
    from meshserve.benchmark.results import Round

    rounds = []
    for index in range(num_rounds):
        configs = {"ours": replace(config, seed=config.seed + index)}
        if peer_config is not None:
            configs["peer"] = replace(peer_config, seed=config.seed + index)
        order = list(configs)[::-1] if index % 2 else list(configs)
        runs = {}
        for name in order:
            if index or runs:
                time.sleep(pause)
            runs[name] = run(run_benchmark(configs[name]))
        rounds.append(Round(runs["ours"], runs.get("peer"), peer_first=order[0] == "peer"))
        if num_rounds > 1:
            print(format_round(index, num_rounds, rounds[-1]), flush=True)
    return rounds
