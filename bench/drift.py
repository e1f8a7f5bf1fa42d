"""Whether an engine computes slower inside a Ray actor, or the machine itself drifts: the same
offline engine in a plain process and in a Ray actor (and vLLM's with ``--peer-python``), all
long-lived, taking turns at the same bursts.

    .venv/bin/python bench/drift.py [--rounds 10] [--peer-python ~/vllm-peer/bin/python]
        [--beside-server]

A served engine runs in a host actor: a Ray worker process (niceness 15, Ray's threads beside the
engine's). When its bursts run slower than the offline engine's, the cause is either that process
or the machine at that moment. Here every round gives each engine the same fresh prompts
(``--num-prompts`` x ``--max-tokens``, greedy, EOS ignored, ``max_num_seqs`` = ``--concurrency``; a
new seed each round, so no prefix cache serves a prompt), rotating which engine goes first, and the
engines take turns within seconds (``--pause``, 5 s, before each burst: vLLM-CPU's worker keeps
polling a core for about a second after its own burst). A slow round that every engine shows is the
machine's (on a shared VM: its host's other tenants, its clock); a slowdown only the actor shows is
the process's. Nothing else should run meanwhile; with ``--beside-server``, one ``meshserve serve``
on 127.0.0.1 (``--port``) is up and idle through the rounds, as the serving processes are beside a
served engine, and each burst records how long after the server's start it began.

Reports each burst's throughput and CPU-seconds (the engine's whole process; beside them, what
every kind of process on the machine spent meanwhile: ``process_cpu.py``), each engine's median
and spread, the rounds (from 1) an engine ran more than 5% below its median, and the correlation
of the engines' throughput across rounds. Writes ``bench/results/drift.json`` and ``drift.png``
(throughput per round, one line per engine). On a machine without an accelerator these are CPU
figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bursts import READY, serve, timed
from common import REPO_ROOT, machine_info, write_json
from offline import export_hf_folder, native_dtypes
from process_cpu import ProcessCpu
from serving import MESHSERVE, SETTLE_S, Server
from vllm_worker import CPU_SETTINGS

SLOW = 0.95  # a burst below this share of its engine's median throughput is a slow one


class MeshserveBursts:
    """meshserve's offline engine with the served engine's CPUs and threads, warmed up."""

    def __init__(self, dtype: str, concurrency: int, max_tokens: int) -> None:
        from meshserve import LLM, SamplingParams
        from meshserve.actors.cpus import claim_engine_cpus

        claim_engine_cpus(0)  # what a host actor does: one torch thread per CPU
        self.llm = LLM(dtype=dtype, max_num_seqs=concurrency)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.generate(["Warm-up: say something about the sea."] * 4)

    def generate(self, prompts: list[str]) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.llm.generate(prompts, self.params))

    def burst(self, prompts: list[str]) -> dict[str, float]:
        return timed(self.generate, prompts)


class WorkerProcess:
    """An engine in a child process that answers bursts over its stdin and stdout."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=REPO_ROOT, env=env)
        for line in self.process.stdout:  # the engine's own lines go to stderr
            if line.strip() == READY:
                return
        raise RuntimeError(f"{command[0]} {command[1]} exited before its engine was ready "
                           f"(exit code {self.process.wait()})")

    def burst(self, prompts: list[str]) -> dict[str, float]:
        self.process.stdin.write(json.dumps(prompts) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited mid-burst (exit code {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


class ActorEngine:
    """``MeshserveBursts`` in a Ray actor on a local cluster started as ``meshserve serve``
    starts its own (127.0.0.1, no dashboard, the same environment)."""

    def __init__(self, dtype: str, concurrency: int, max_tokens: int) -> None:
        import ray

        from meshserve.cli import CALM_RAY_ENV

        for name, value in CALM_RAY_ENV.items():
            os.environ.setdefault(name, value)
        # Ray's workers inherit this environment: the actor unpickles MeshserveBursts, which
        # needs this folder's modules.
        here = str(Path(__file__).parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [here, os.environ.get("PYTHONPATH")]))
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 logging_level="WARNING")
        remote = ray.remote(num_cpus=os.cpu_count())(MeshserveBursts)
        self.actor = remote.remote(dtype, concurrency, max_tokens)
        ray.get(self.actor.__ray_ready__.remote())

    def burst(self, prompts: list[str]) -> dict[str, float]:
        import ray

        return ray.get(self.actor.burst.remote(prompts))

    def close(self) -> None:
        import ray

        ray.shutdown()


def start_engines(args: argparse.Namespace, dtype: str, engines: dict[str, Any]) -> None:
    """Start every engine into ``engines`` (the caller closes those that started)."""
    config = [dtype, args.concurrency, args.max_tokens]
    print("starting the plain process's engine...", flush=True)
    engines["plain process"] = WorkerProcess(
        [sys.executable, __file__, "--worker", json.dumps(config)])
    print("starting the Ray actor's engine...", flush=True)
    engines["Ray actor"] = ActorEngine(*config)
    if args.peer_python:
        if not (Path(args.peer_model) / "config.json").exists():
            export_hf_folder(Path(args.peer_model))
        print("starting vLLM's engine...", flush=True)
        engines["vLLM"] = WorkerProcess(
            [args.peer_python, str(Path(__file__).with_name("vllm_worker.py")), "--model",
             str(args.peer_model), "--dtype", dtype, "--max-tokens", str(args.max_tokens),
             "--max-num-seqs", str(args.concurrency), "--bursts"],
            env=dict(os.environ, **CPU_SETTINGS))


def idle_server(args: argparse.Namespace) -> Server:
    """``meshserve serve`` with its defaults, ready; its log goes beside the results."""
    log = args.output.parent / "drift-logs" / "meshserve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting meshserve serve on 127.0.0.1:{args.port} (log: {log})...", flush=True)
    server = Server([MESHSERVE, "serve", "--host", "127.0.0.1", "--port", str(args.port)],
                    f"http://127.0.0.1:{args.port}", log, dict(os.environ))
    try:
        server.wait_ready(900)
    except BaseException:  # a server that never got ready is not left behind
        server.stop()
        raise
    return server


def run_rounds(engines: dict[str, Any], args: argparse.Namespace,
               server_started: float | None) -> list[dict[str, Any]]:
    from meshserve.benchmark.prompts import synthetic_prompts

    names = list(engines)
    for name in names:  # one unmeasured burst each: the allocator's and caches' first growth
        engines[name].burst(synthetic_prompts(args.num_prompts, args.seed - 1))
    bursts = []
    for index in range(args.rounds):
        prompts = synthetic_prompts(args.num_prompts, args.seed + index)
        for turn in range(len(names)):
            name = names[(index + turn) % len(names)]
            time.sleep(args.pause)  # the engine before may still wind down (vLLM's polls)
            since_server = (None if server_started is None
                            else round(time.monotonic() - server_started, 1))
            with ProcessCpu() as cpu:
                figures = engines[name].burst(prompts)
            bursts.append({"round": index + 1, "turn": turn, "engine": name, **figures,
                           "cpu_s_by_process": cpu.by_kind, "s_after_server_start": since_server})
            print(f"round {index + 1}/{args.rounds} {name}: {figures['output_throughput']} tok/s, "
                  f"{figures['cpu_s']} CPU-s", flush=True)
    return bursts


def summarize(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(dict.fromkeys(b["engine"] for b in bursts))
    rates = {n: [b["output_throughput"] for b in bursts if b["engine"] == n] for n in names}
    engines = {}
    for name in names:
        median = statistics.median(rates[name])
        cpu = [b["cpu_s"] for b in bursts if b["engine"] == name]
        engines[name] = {
            "throughput_median": median, "throughput_min": min(rates[name]),
            "throughput_max": max(rates[name]),
            "spread": round(max(rates[name]) / min(rates[name]), 3),
            "cpu_s_median": statistics.median(cpu), "cpu_s_min": min(cpu), "cpu_s_max": max(cpu),
            "slow_rounds": [i for i, r in enumerate(rates[name], 1) if r < SLOW * median],
        }
    # Rounds in which the engines move together: the machine's drift, not a process's.
    correlation = {f"{a} ~ {b}": round(statistics.correlation(rates[a], rates[b]), 3)
                   for a, b in itertools.combinations(names, 2) if len(rates[a]) > 2}
    return {"engines": engines, "throughput_correlation": correlation}


def plot(path: Path, bursts: list[dict[str, Any]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(b["engine"] for b in bursts):
        mine = [b for b in bursts if b["engine"] == name]
        ax.plot([b["round"] for b in mine], [b["output_throughput"] for b in mine],
                marker="o", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="max_num_seqs of every engine")
    p.add_argument("--seed", type=int, default=1000, help="round i's prompts use seed + i")
    p.add_argument("--dtype", default=None, help="default: the CPU's native dtype")
    p.add_argument("--peer-python", default=None, help="a venv's python with vLLM's CPU build")
    p.add_argument("--peer-model", default=str(Path.home() / "models/smollm2-135m-instruct-hf"),
                   help="Hugging Face folder of the bundled model (written from the GGUF if "
                   "absent)")
    p.add_argument("--beside-server", action="store_true",
                   help="keep an idle `meshserve serve` up beside the engines")
    p.add_argument("--port", type=int, default=8000, help="the idle server's port")
    p.add_argument("--pause", type=float, default=SETTLE_S,
                   help="seconds of quiet before each burst: vLLM-CPU's worker polls a core for "
                        "about a second after its burst, which would fall on the next engine's")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/drift.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run as the plain process
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be at least 3 (the correlation needs them)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        serve(MeshserveBursts(*json.loads(args.worker)).generate)
        return
    dtype = args.dtype or native_dtypes()[0]
    server_started = time.monotonic() if args.beside_server else None
    server = idle_server(args) if args.beside_server else None
    engines: dict[str, Any] = {}
    try:
        start_engines(args, dtype, engines)
        bursts = run_rounds(engines, args, server_started)
    finally:
        for engine in engines.values():
            engine.close()
        if server is not None:
            server.stop()
    summary, machine = summarize(bursts), machine_info()
    config = {k: v for k, v in vars(args).items() if k not in ("output", "worker")}
    write_json(args.output, {"machine": machine, "dtype": dtype, "config": config,
                             "summary": summary, "bursts": bursts})
    plot(args.output.with_suffix(".png"), bursts,
         f"{args.num_prompts} x {args.max_tokens} tokens at {args.concurrency}, {dtype}, "
         f"{machine['cpu_model']} (CPU figures)")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
