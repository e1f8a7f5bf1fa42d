"""Serving against the same engine offline and against vLLM-CPU's OpenAI server, in one run.

    .venv/bin/python bench/serving.py --peer-python ~/vllm-peer/bin/python

On the same prompts (64 synthetic completions x 64 tokens, EOS ignored, greedy):

1. **offline**: ``LLM.generate`` in its own process, with as many sequences in flight as the
   servers get (``max_num_seqs`` = the concurrency), the engine's own figure;
2. **meshserve**: ``meshserve serve`` on 127.0.0.1, streamed through ``meshserve bench serve``'s
   client at that concurrency;
3. **peer** (with ``--peer-python``): vLLM's OpenAI server from that venv, on a Hugging Face
   folder of the same weights, through the same client.

Every engine runs in the CPU's native dtype unless ``--dtype`` says otherwise. Writes
``bench/results/serving.json`` (both servers' requests, the ratios, the offline figure) with the
latency chart beside it, and ``serving_throughput.png``. CPU figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from common import REPO_ROOT, bar_chart, machine_info, write_json
from offline import export_hf_folder, native_dtypes

MESHSERVE = str(Path(sys.executable).with_name("meshserve"))
_OFFLINE = """
import json, sys, time
from meshserve import LLM, SamplingParams
prompts, max_tokens, concurrency, dtype = json.loads(sys.argv[1])
llm = LLM(dtype=dtype, max_num_seqs=concurrency)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
start = time.perf_counter()
outputs = llm.generate(prompts, params)
elapsed = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"output_tokens": tokens, "elapsed_s": elapsed,
                  "output_throughput": tokens / elapsed}))
"""


def run_offline(prompts: list[str], max_tokens: int, concurrency: int, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _OFFLINE,
                           json.dumps([prompts, max_tokens, concurrency, dtype])],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode:
        raise RuntimeError(f"the offline run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Server:
    """A server process in its own session, stopped with SIGINT (then SIGKILL) as a user would."""

    def __init__(self, command: list[str], url: str, log: Path, env: dict[str, str]) -> None:
        self.url = url
        self.log = log.open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, cwd=REPO_ROOT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.process.returncode}; "
                                   f"see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)  # polling a server that is still loading; the condition is /health
        raise TimeoutError(f"{self.url} was not ready within {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.log.close()


def bench_server(server: Server, model: str | None, args: argparse.Namespace):
    from meshserve.benchmark.client import run_benchmark, served_model
    from meshserve.benchmark.results import BenchConfig

    server.wait_ready(args.ready_timeout)
    config = BenchConfig(url=server.url, model=model or "unset", num_prompts=args.num_prompts,
                         concurrency=args.concurrency, stream=True, max_tokens=args.max_tokens,
                         seed=args.seed, timeout=args.timeout)
    if model is None:
        config = BenchConfig(**{**_fields(config), "model": asyncio.run(served_model(config))})
    return asyncio.run(run_benchmark(config))


def _fields(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def peer_server(args: argparse.Namespace, dtype: str, logs: Path) -> Server:
    folder = Path(args.peer_model)
    if not (folder / "config.json").exists():
        export_hf_folder(folder)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_HOST_IP="127.0.0.1")
    command = [args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(folder), "--host", "127.0.0.1", "--port", str(args.peer_port),
               "--max-model-len", "2048", "--dtype", dtype]
    return Server(command, f"http://127.0.0.1:{args.peer_port}", logs / "peer.log", env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the CPU's native")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--peer-python", help="python of a venv with vLLM's CPU build")
    p.add_argument("--peer-model", default=str(Path.home() / "models/smollm2-135m-instruct-hf"),
                   help="Hugging Face folder of the bundled model (written from the GGUF if absent)")
    p.add_argument("--peer-port", type=int, default=8011)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one server's run")
    p.add_argument("--output", default=str(REPO_ROOT / "bench/results/serving.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from meshserve.benchmark.prompts import synthetic_prompts
    from meshserve.benchmark.report import compare, format_table, write_report

    args = parse_args(argv)
    dtype = native_dtypes()[0] if args.dtype == "auto" else args.dtype
    output = Path(args.output)
    logs = output.parent / "serving-logs"
    logs.mkdir(parents=True, exist_ok=True)
    prompts = synthetic_prompts(args.num_prompts, args.seed)
    print(f"offline: {args.num_prompts} prompts, {args.concurrency} in flight, {dtype}", flush=True)
    offline = run_offline(prompts, args.max_tokens, args.concurrency, dtype)
    print(f"offline: {offline['output_throughput']:.1f} tok/s", flush=True)

    ours = Server([MESHSERVE, "serve", "--host", "127.0.0.1", "--port", str(args.port),
                   "--dtype", dtype], f"http://127.0.0.1:{args.port}", logs / "meshserve.log",
                  dict(os.environ))
    try:
        result = bench_server(ours, None, args)
    finally:
        ours.stop()
    print(format_table(result), flush=True)
    peer = None
    if args.peer_python:
        server = peer_server(args, dtype, logs)
        try:
            peer = bench_server(server, None, args)
        finally:
            server.stop()
        print(format_table(peer), flush=True)

    json_path, png_path = write_report(result, output, peer)
    report = json.loads(json_path.read_text())
    ours_tps = result.summary()["output_throughput"]
    report["offline"] = {**offline, "dtype": dtype, "max_num_seqs": args.concurrency}
    report["http_share_of_offline"] = round(ours_tps / offline["output_throughput"], 3)
    report["bench_machine"] = machine_info()
    write_json(json_path, report)
    groups = ["meshserve offline", "meshserve HTTP"] + (["vLLM-CPU HTTP"] if peer else [])
    values = [offline["output_throughput"], ours_tps]
    if peer:
        values.append(peer.summary()["output_throughput"])
    bar_chart(output.with_name(output.stem + "_throughput.png"), groups, {dtype: values},
              title=f"{args.num_prompts} streams x {args.max_tokens} tokens, concurrency "
                    f"{args.concurrency}; {report['bench_machine']['cpu_model']} (CPU figures)",
              ylabel="output tokens/s")
    print(f"HTTP keeps {report['http_share_of_offline']:.0%} of offline", flush=True)
    if peer:
        print(f"against vLLM-CPU's server: {compare(result, peer)}", flush=True)
    print(f"wrote {json_path}, {png_path}", flush=True)


if __name__ == "__main__":
    main()
