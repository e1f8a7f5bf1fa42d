"""Serving against the same engine offline and against vLLM-CPU's OpenAI server, in one run.

    .venv/bin/python bench/serving.py --peer-python ~/vllm-peer/bin/python

On the same prompts (64 synthetic completions x 64 tokens, EOS ignored, greedy):

1. **offline**: ``LLM.generate`` in its own process, with as many sequences in flight as the
   servers get (``max_num_seqs`` = the concurrency), the engine's own figure;
2. **meshserve**: ``meshserve serve`` on 127.0.0.1, streamed through ``meshserve bench serve``'s
   client at that concurrency (its default edge: the ingress replica answers HTTP itself);
   with ``--proxy-leg``, also **proxy**: the same server with ``--edge proxy`` (Ray Serve's proxy
   in front of the ingress, as on KubeRay);
3. **peer** (with ``--peer-python``): vLLM's OpenAI server from that venv, on a Hugging Face
   folder of the same weights, through the same client; and **peer offline**: vLLM's ``LLM``
   on the same prompts with ``max_num_seqs`` = the concurrency (``vllm_worker.py``), so the
   peer's HTTP share of its own offline engine is measured beside meshserve's.

With ``--idle-floor``, the offline leg also runs once more in each round while meshserve's server
is up and idle (after its HTTP workload, before it stops): **offline beside the idle server**.
Its share of the offline figure (``idle_floor_share``) is what the serving processes cost the
engine with no request in flight (on 2 cores, every wake-up of Ray's and Serve's processes takes
a core from one of the engine's threads, and its partner waits at the next barrier); the HTTP
figure over it (``http_share_of_offline_beside``) is what the requests themselves cost.

With ``--reserved-cpus N``, meshserve serves with ``--reserved-cpus N`` (its engine pinned to all
CPUs but the first N, one thread each, leaving those to the serving processes) and its offline
legs pin themselves the same way, so every meshserve figure is of the same engine.

Every leg is warmed up before it is measured: the offline engine with a short ``generate`` of
four prompts that share no prefix with the measured ones, each server with the same four prompts
through the client, then ``SETTLE_S`` of quiet, so that no leg's figure holds first-use costs or
the tail of its start. Every engine runs in the CPU's native dtype unless ``--dtype`` says
otherwise. The three legs run ``--rounds`` times (3), each round starting one leg later than
the last: on a shared VM the same leg drifts by more than the gaps measured here, so ratios are
taken within a round and reported as medians over rounds. Each leg also records the CPU-seconds
every kind of process spent while it ran (``process_cpu.py``: the engine, Serve's proxy and
controller, the ingress, Ray's daemons, the client), which tells the edge's share from the
engine's and shows the machine's drift.
meshserve's legs also record the engine steps the workload took and their mean time (the
``meshserve_engine_steps`` / ``meshserve_engine_execute_seconds`` gauges of /metrics, the
engine's own counters offline): both run the same schedule, so ``served_step_over_offline`` says
how much slower a step runs inside the server. ``cpu_wait_share`` (``..._cpu_wait_seconds`` over
the execute seconds) is the part of a step the stepping thread spent runnable but off its core,
which another process had taken; its OpenMP partners then wait at the next barrier, so a served
step loses about twice that share.

Writes ``bench/results/serving.json`` (every round's figures, ratios, CPU split and steps, their
medians, and the requests of the median round) with that round's latency chart beside it, and
``serving_throughput.png`` (medians). With a peer it also pools every round's requests
(``pooled_against_peer``): TTFT and TPOT medians over all of them, their ratios, and a 90%
interval from resampling whole rounds, since one round's TTFT p50 jumps between waves of first
tokens. CPU figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from meshserve.benchmark.cli import DEFAULT_PAUSE_S
from meshserve.deploy.listener import listening_socket

from common import REPO_ROOT, bar_chart, machine_info, write_json
from offline import export_hf_folder, native_dtypes
from process_cpu import ProcessCpu
from vllm_worker import CPU_SETTINGS

MESHSERVE = str(Path(sys.executable).with_name("meshserve"))
BESIDE = "offline beside the idle server"  # the --idle-floor leg
WARM_UP_TOKENS = 8  # each warm-up prompt's output, in every leg
# After a server's warm-up, before its measured run: `bench serve --pause`'s default, long enough
# for work that outlives a run to end before the next.
SETTLE_S = DEFAULT_PAUSE_S
_OFFLINE = """
import json, sys, time
from meshserve import LLM, SamplingParams
from meshserve.actors.cpus import claim_engine_cpus
prompts, warm_up, warm_up_tokens, max_tokens, concurrency, dtype, reserved_cpus = json.loads(
    sys.argv[1])
claim_engine_cpus(reserved_cpus)  # the served engine's CPUs and threads: the same engine
llm = LLM(dtype=dtype, max_num_seqs=concurrency)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
llm.generate(warm_up, SamplingParams(temperature=0.0, max_tokens=warm_up_tokens, ignore_eos=True))
before = llm.engine.stats()
start, cpu_start = time.perf_counter(), time.process_time()
outputs = llm.generate(prompts, params)
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
after = llm.engine.stats()
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"output_tokens": tokens, "elapsed_s": elapsed,
                  "output_throughput": tokens / elapsed, "cpu_s": round(cpu, 1),
                  "steps": after.num_steps - before.num_steps,
                  "execute_s": after.execute_seconds - before.execute_seconds,
                  "cpu_wait_s": after.cpu_wait_seconds - before.cpu_wait_seconds}))
"""


def run_peer_offline(args: argparse.Namespace, prompts: list[str], dtype: str) -> dict:
    """vLLM's ``LLM.generate`` on the prompts in the peer's venv (``vllm_worker.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path, result_path = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        prompts_path.write_text(json.dumps(prompts), encoding="utf-8")
        done = subprocess.run([args.peer_python, str(Path(__file__).with_name("vllm_worker.py")),
                               "--model", str(peer_folder(args)), "--dtype", dtype,
                               "--prompts", str(prompts_path), "--max-tokens",
                               str(args.max_tokens), "--max-num-seqs", str(args.concurrency),
                               "--output", str(result_path)],
                              capture_output=True, text=True, cwd=REPO_ROOT)
        if done.returncode:
            raise RuntimeError(f"the peer's offline run failed:\n{done.stderr[-3000:]}")
        raw = json.loads(result_path.read_text(encoding="utf-8"))
    tokens = sum(len(ids) for ids in raw["output_token_ids"])
    return {"output_tokens": tokens, "elapsed_s": raw["elapsed_s"],
            "output_throughput": tokens / raw["elapsed_s"]}


def warm_up_prompts(prompts: list[str]) -> list[str]:
    """What every leg but vLLM's offline one (``vllm_worker.py`` warms its own) runs before it is
    measured (``WARM_UP_TOKENS`` each): the first prompts behind a prefix, so they share no
    leading block with the measured ones and the prefix cache skips no measured prefill."""
    return ["Warm-up. " + p for p in prompts[:4]]


def run_offline(prompts: list[str], args: argparse.Namespace, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _OFFLINE,
                           json.dumps([prompts, warm_up_prompts(prompts), WARM_UP_TOKENS,
                                       args.max_tokens, args.concurrency, dtype,
                                       args.reserved_cpus])],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode:
        raise RuntimeError(f"the offline run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Server:
    """A server process in its own session, stopped with SIGINT (then SIGKILL) as a user would."""

    def __init__(self, command: list[str], url: str, log: Path, env: dict[str, str]) -> None:
        # A server already there would pass for this one: its /health says 200 before this one
        # has even found the port taken, and every figure would be that server's. The same
        # check as `meshserve serve` makes before it starts.
        address = urllib.parse.urlsplit(url)
        try:
            listening_socket(address.hostname, address.port, shared=False).close()
        except OSError as exc:
            raise RuntimeError(f"{exc.strerror}; stop what listens there first") from None
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


def bench_server(server: Server, args: argparse.Namespace, warm_up: list[str],
                 then: Callable[[], None] | None = None
                 ) -> tuple[Any, dict[str, float], dict[str, float] | None]:
    """Wait for ``server``, warm it up as the offline legs warm their engine (the ``warm_up``
    prompts, ``WARM_UP_TOKENS`` each) and give it ``SETTLE_S`` to finish whatever that and its
    start left running, run the workload against the model it serves (then ``then``, with the
    server idle), stop it; returns the results, the CPU-seconds each kind of process spent while
    the workload ran, and the engine steps the workload took (``step_figures``; None for a server
    without meshserve's metrics)."""
    from meshserve.benchmark.client import run, run_benchmark, served_model
    from meshserve.benchmark.results import BenchConfig

    try:
        server.wait_ready(args.ready_timeout)
        config = BenchConfig(url=server.url, model="unset", num_prompts=args.num_prompts,
                             concurrency=args.concurrency, stream=True,
                             max_tokens=args.max_tokens, seed=args.seed, timeout=args.timeout)
        config = replace(config, model=run(served_model(config)))
        with tempfile.TemporaryDirectory() as tmp:
            dataset = Path(tmp) / "warm_up.jsonl"
            dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in warm_up),
                               encoding="utf-8")
            warmed = run(run_benchmark(replace(
                config, dataset=str(dataset), num_prompts=len(warm_up),
                concurrency=len(warm_up), max_tokens=WARM_UP_TOKENS)))
        if len(warmed.completed) != len(warm_up):
            raise RuntimeError(f"{server.url} failed its warm-up: {warmed.errors}")
        time.sleep(SETTLE_S)
        before = engine_counters(server.url)
        with ProcessCpu() as cpu:
            results = run(run_benchmark(config))
        after = engine_counters(server.url)
        steps = None
        if before is not None and after is not None:
            steps = step_figures(*(a - b for a, b in zip(after, before)))
        if then is not None:
            then()
        return results, cpu.by_kind, steps
    finally:
        server.stop()


def engine_counters(url: str) -> tuple[float, float, float] | None:
    """The engines' steps, execute seconds and CPU-wait seconds so far, from meshserve's
    /metrics; None where the server does not export them."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=30)
    if response.status_code != 200:
        return None
    values = {sample.name: sample.value
              for family in text_string_to_metric_families(response.text)
              for sample in family.samples}
    if "meshserve_engine_steps" not in values:
        return None
    return (values["meshserve_engine_steps"], values["meshserve_engine_execute_seconds"],
            values["meshserve_engine_cpu_wait_seconds"])


def step_figures(steps: float, execute_s: float, cpu_wait_s: float) -> dict[str, float]:
    """How many engine steps a leg took, how long one took on average, and the share of that
    time the stepping thread waited for a core another process held: the served and the offline
    engine run the same schedule, so a slower step is where the edge's cost lands, and the wait
    says how much of it is the processes beside the engine taking its cores."""
    return {"steps": int(steps), "execute_s": round(execute_s, 3),
            "step_ms": round(1000 * execute_s / steps, 2) if steps else None,
            "cpu_wait_share": round(cpu_wait_s / execute_s, 3) if execute_s else None}


def peer_folder(args: argparse.Namespace) -> Path:
    """The Hugging Face folder the peer loads, written from the bundled GGUF the first time."""
    folder = Path(args.peer_model)
    if not (folder / "config.json").exists():
        export_hf_folder(folder)
    return folder


def peer_server(args: argparse.Namespace, dtype: str, log: Path) -> Server:
    folder = peer_folder(args)
    env = dict(os.environ, **CPU_SETTINGS)  # the same settings as its offline leg
    command = [args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(folder), "--host", "127.0.0.1", "--port", str(args.peer_port),
               "--max-model-len", "2048", "--dtype", dtype]
    return Server(command, f"http://127.0.0.1:{args.peer_port}", log, env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the CPU's native")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every leg, the order rotating each round (a shared VM drifts "
                        "by more than the gaps measured; medians over rounds are reported)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="meshserve's --reserved-cpus; its offline legs then compute on the same "
                        "CPUs with the same threads")
    p.add_argument("--idle-floor", action="store_true",
                   help="also run the offline engine beside meshserve's idle server, each round")
    p.add_argument("--proxy-leg", action="store_true",
                   help="also run meshserve behind Ray Serve's proxy (--edge proxy)")
    p.add_argument("--peer-python", help="python of a venv with vLLM's CPU build")
    p.add_argument("--peer-model", default=str(Path.home() / "models/smollm2-135m-instruct-hf"),
                   help="Hugging Face folder of the bundled model (written from the GGUF if "
                        "absent)")
    p.add_argument("--peer-port", type=int, default=8011)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one server's run")
    p.add_argument("--output", default=str(REPO_ROOT / "bench/results/serving.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def run_rounds(args: argparse.Namespace, prompts: list[str], dtype: str,
               logs: Path) -> list[dict[str, Any]]:
    """Every leg once per round; each round starts one leg later, so no leg always runs first
    (when the machine is freshest) or right after the same neighbour."""
    beside: dict[int, dict] = {}  # round -> the offline leg's figures beside the idle server
    warm_up = warm_up_prompts(prompts)

    def meshserve(index: int, edge: str = "ingress") -> tuple[Any, dict[str, float], Any]:
        server = Server([MESHSERVE, "serve", "--host", "127.0.0.1", "--port", str(args.port),
                         "--dtype", dtype, "--edge", edge, "--reserved-cpus",
                         str(args.reserved_cpus)], f"http://127.0.0.1:{args.port}",
                        logs / f"meshserve-{edge}-{index}.log", dict(os.environ))

        def idle_floor() -> None:
            print(f"round {index}/{args.rounds}: {BESIDE}", flush=True)
            beside[index] = run_offline(prompts, args, dtype)
            print(_one_line(BESIDE, beside[index]), flush=True)

        return bench_server(server, args, warm_up, idle_floor
                            if args.idle_floor and edge == "ingress" else None)

    def proxy(index: int) -> tuple[Any, dict[str, float], Any]:
        return meshserve(index, "proxy")

    def peer(index: int) -> tuple[Any, dict[str, float], Any]:
        return bench_server(peer_server(args, dtype, logs / f"peer-{index}.log"), args,
                            warm_up)

    def offline(index: int) -> tuple[dict, dict[str, float], dict[str, float]]:
        figures = run_offline(prompts, args, dtype)
        return (figures, {"LLM.generate": figures["cpu_s"]},
                step_figures(figures["steps"], figures["execute_s"], figures["cpu_wait_s"]))

    def peer_offline(index: int) -> tuple[dict, dict[str, float], None]:
        # its engine runs in a child process: no CPU split, no step counters
        return run_peer_offline(args, prompts, dtype), {}, None

    legs = {"offline": offline, "meshserve": meshserve}
    if args.proxy_leg:
        legs["proxy"] = proxy
    if args.peer_python:
        legs["peer"] = peer
        legs["peer offline"] = peer_offline
    names = list(legs)
    rounds = []
    for index in range(args.rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        measured: dict[str, Any] = {"order": order, "cpu_s": {}, "engine_steps": {}}
        for name in order:
            print(f"round {index + 1}/{args.rounds}: {name}", flush=True)
            measured[name], measured["cpu_s"][name], steps = legs[name](index + 1)
            print(_one_line(name, measured[name]), flush=True)
            print(f"    CPU-seconds: {_top_cpu(measured['cpu_s'][name])}", flush=True)
            if steps is not None:
                measured["engine_steps"][name] = steps
                print(f"    engine: {steps['steps']} steps, {steps['step_ms']} ms a step, "
                      f"waiting for a core {steps['cpu_wait_share']} of it", flush=True)
        if index + 1 in beside:
            measured[BESIDE] = beside[index + 1]
        rounds.append(measured)
    return rounds


def _one_line(name: str, measured: Any) -> str:
    if name in ("offline", "peer offline", BESIDE):
        return f"  {name}: {measured['output_throughput']:.1f} tok/s"
    s = measured.summary()
    return (f"  {name}: {s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} "
            f"ms, TPOT p50 {s['tpot_ms']['p50']:.0f} ms, {s['failed']} failed")


def _top_cpu(by_kind: dict[str, float], count: int = 5) -> str:
    return ", ".join(f"{kind} {seconds}" for kind, seconds in list(by_kind.items())[:count])


def round_record(measured: dict[str, Any]) -> dict[str, Any]:
    """One round in plain data: each leg's figures and the ratios within the round."""
    from meshserve.benchmark.report import compare

    def share(served: dict, offline: dict) -> float:
        return round(served["output_throughput"] / offline["output_throughput"], 3)

    ours = measured["meshserve"].summary()
    record = {"order": measured["order"], "offline": measured["offline"], "meshserve": ours,
              "http_share_of_offline": share(ours, measured["offline"]),
              "cpu_s": measured["cpu_s"], "engine_steps": measured["engine_steps"]}
    steps = measured["engine_steps"]
    if steps.get("meshserve", {}).get("step_ms") and steps.get("offline", {}).get("step_ms"):
        record["served_step_over_offline"] = round(
            steps["meshserve"]["step_ms"] / steps["offline"]["step_ms"], 3)
    if BESIDE in measured:
        floor = record["offline_beside_idle_server"] = measured[BESIDE]
        record["idle_floor_share"] = share(floor, measured["offline"])
        record["http_share_of_offline_beside"] = share(ours, floor)
    if "proxy" in measured:
        record["proxy"] = measured["proxy"].summary()
        record["proxy_share_of_offline"] = share(record["proxy"], measured["offline"])
    if "peer" in measured:
        record["peer"] = measured["peer"].summary()
        record["against_peer"] = compare(measured["meshserve"], measured["peer"])
        record["peer_offline"] = measured["peer offline"]
        record["peer_http_share_of_offline"] = share(record["peer"], measured["peer offline"])
    return record


def main(argv: list[str] | None = None) -> None:
    from meshserve.benchmark.prompts import synthetic_prompts
    from meshserve.benchmark.report import format_comparison, format_table, write_report

    args = parse_args(argv)
    dtype = native_dtypes()[0] if args.dtype == "auto" else args.dtype
    output = Path(args.output)
    logs = output.parent / "serving-logs"
    logs.mkdir(parents=True, exist_ok=True)
    prompts = synthetic_prompts(args.num_prompts, args.seed)
    print(f"{args.rounds} rounds of {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"{args.concurrency} in flight, {dtype}", flush=True)
    rounds = run_rounds(args, prompts, dtype, logs)
    records = [round_record(measured) for measured in rounds]

    # The latency chart and the top-level runs: the round whose meshserve throughput is the
    # median, with its own peer run.
    middle = sorted(range(len(rounds)), key=lambda i: records[i]["meshserve"]["output_throughput"])
    chosen = rounds[middle[len(middle) // 2]]
    json_path, png_path = write_report(chosen["meshserve"], output, chosen.get("peer"))
    report = json.loads(json_path.read_text())
    report["rounds"] = records
    report["median"] = medians(records)
    if args.peer_python:
        report["pooled_against_peer"] = pooled_against_peer(rounds)
    report["offline_settings"] = {"dtype": dtype, "max_num_seqs": args.concurrency,
                                  "reserved_cpus": args.reserved_cpus}
    report["bench_machine"] = machine_info()
    write_json(json_path, report)

    median = report["median"]
    throughput_chart(output.with_name(output.stem + "_throughput.png"), median, args, dtype,
                     report["bench_machine"]["cpu_model"])
    print(format_table(chosen["meshserve"]), flush=True)
    if "peer" in chosen:
        print(format_table(chosen["peer"]), flush=True)
        print(format_comparison(chosen["meshserve"], chosen["peer"]), flush=True)
    print(f"medians over {args.rounds} rounds: {json.dumps(median)}", flush=True)
    if args.peer_python:
        print(f"every round's requests pooled: {json.dumps(report['pooled_against_peer'])}",
              flush=True)
    print(f"wrote {json_path}, {png_path}", flush=True)


def throughput_chart(path: Path, median: dict[str, float | None], args: argparse.Namespace,
                     dtype: str, cpu_model: str) -> None:
    """The median throughput of every leg the run had, one bar each."""
    groups, values = ["meshserve\noffline", "meshserve\nHTTP"], [median["offline_throughput"],
                                                               median["meshserve_throughput"]]
    if args.idle_floor:
        groups.insert(1, "offline, idle\nserver beside")
        values.insert(1, median["offline_beside_idle_server_throughput"])
    if args.proxy_leg:
        groups.append("meshserve HTTP via\nServe's proxy")
        values.append(median["proxy_throughput"])
    if args.peer_python:
        groups += ["vLLM-CPU\noffline", "vLLM-CPU\nHTTP"]
        values += [median["peer_offline_throughput"], median["peer_throughput"]]
    reserved = (f"; meshserve with --reserved-cpus {args.reserved_cpus}"
                if args.reserved_cpus else "")
    bar_chart(path, groups, {dtype: values},
              title=f"medians of {args.rounds} rounds: {args.num_prompts} streams x "
                    f"{args.max_tokens} tokens, concurrency {args.concurrency}{reserved}; "
                    f"{cpu_model} (CPU figures)",
              ylabel="output tokens/s")


def pooled_against_peer(rounds: list[dict[str, Any]], resamples: int = 2000
                        ) -> dict[str, Any]:
    """TTFT and TPOT medians over every round's requests together, meshserve's over the peer's.

    One round's TTFT p50 falls where a wave of first tokens changes step, so it jumps by a step
    between identical runs; pooling the rounds' requests spreads the median over many wave
    edges. The interval comes from resampling whole rounds (requests within a round share their
    waves, so they are not independent draws); the 5th and 95th percentile of the ratio."""
    def latencies(leg: str, name: str) -> list[np.ndarray]:
        return [np.array([getattr(r, name) for r in measured[leg].completed
                          if getattr(r, name) is not None]) for measured in rounds]

    def pooled(per_round: list[np.ndarray]) -> float:
        return float(np.median(np.concatenate(per_round)))

    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"rounds": len(rounds)}
    for name in ("ttft", "tpot"):
        ours, theirs = latencies("meshserve", name), latencies("peer", name)
        if not all(len(a) for a in ours + theirs):
            continue
        draws = []
        for _ in range(resamples):
            picked = rng.integers(len(rounds), size=len(rounds))
            draws.append(pooled([ours[i] for i in picked]) / pooled([theirs[i] for i in picked]))
        low, high = np.percentile(draws, [5, 95])
        result[f"meshserve_{name}_p50_ms"] = round(pooled(ours) * 1000, 1)
        result[f"peer_{name}_p50_ms"] = round(pooled(theirs) * 1000, 1)
        result[f"{name}_p50_ratio"] = round(pooled(ours) / pooled(theirs), 3)
        result[f"{name}_p50_ratio_90pct"] = [round(float(low), 3), round(float(high), 3)]
        result[f"rounds_{name}_p50_at_or_below_peer"] = sum(
            float(np.median(a)) <= float(np.median(b)) for a, b in zip(ours, theirs))
    return result


def medians(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over rounds; the ratios are taken within each round first."""
    def mid(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 3) if known else None

    result = {"offline_throughput": mid([r["offline"]["output_throughput"] for r in records]),
              "meshserve_throughput": mid([r["meshserve"]["output_throughput"] for r in records]),
              "http_share_of_offline": mid([r["http_share_of_offline"] for r in records]),
              "served_step_over_offline": mid([r.get("served_step_over_offline")
                                               for r in records]),
              "served_cpu_wait_share": mid([r["engine_steps"].get("meshserve", {})
                                            .get("cpu_wait_share") for r in records])}
    if all("idle_floor_share" in r for r in records):
        result["offline_beside_idle_server_throughput"] = mid(
            [r["offline_beside_idle_server"]["output_throughput"] for r in records])
        for key in ("idle_floor_share", "http_share_of_offline_beside"):
            result[key] = mid([r[key] for r in records])
    if all("proxy" in r for r in records):
        result["proxy_throughput"] = mid([r["proxy"]["output_throughput"] for r in records])
        result["proxy_share_of_offline"] = mid([r["proxy_share_of_offline"] for r in records])
    if all("peer" in r for r in records):
        result["peer_throughput"] = mid([r["peer"]["output_throughput"] for r in records])
        result["peer_offline_throughput"] = mid([r["peer_offline"]["output_throughput"]
                                                 for r in records])
        result["peer_http_share_of_offline"] = mid([r["peer_http_share_of_offline"]
                                                    for r in records])
        for key in ("output_throughput", "ttft_p50", "tpot_p50"):
            result[f"against_peer_{key}"] = mid([r["against_peer"][key] for r in records])
    return result


if __name__ == "__main__":
    main()
