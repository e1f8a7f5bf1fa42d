"""Router latency: what the Ray actor hop and the Serve router add to one engine's latency.

The same greedy requests (ignore_eos, one at a time, so nothing queues) go three ways, each on its
own engine of the same model and settings, on a local Ray bound to 127.0.0.1:

- ``engine``: an ``EngineCore`` in this process, stepped by hand in a thread as a host actor
  steps its own: the floor.
- ``host actor``: a ``HostActor`` called through Ray (``generate_stream``): the actor hop.
- ``router``: the Serve application's ``Router`` deployment handle (``generate_stream``): the
  Serve hop, the router's pick and its per-sequence stream, then the host actor.

Per request it records the time to the first token (TTFT, from submission) and the time per output
token after it (TPOT); it reports medians and what each path adds to the engine's. On a machine
without an accelerator these are CPU figures.

    .venv/bin/python bench/router_latency.py [--num-requests 16] [--max-tokens 32]
        [--model PATH] [--output bench/results/router_latency.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported

import argparse  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from common import REPO_ROOT, bar_chart, machine_info, write_json  # noqa: E402
from offline import build_prompts  # noqa: E402

PATHS = ("engine", "host actor", "router")


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    tpot_s: float
    tokens: int


def timed(submit: Callable[[], Iterable[int]]) -> Sample:
    """Time one request; ``submit`` starts it and yields the number of tokens in each arrival."""
    start = time.perf_counter()
    first = last = None
    count = 0
    for n in submit():
        if n == 0:
            continue  # a prefill chunk that produced no token
        last = time.perf_counter()
        first = first or last
        count += n
    assert first is not None and last is not None and count > 1
    return Sample(first - start, (last - first) / (count - 1), count)


def run_engine(config, prompts: list[list[int]], params) -> list[Sample]:
    """Build an engine here and step it by hand in a thread of its own, exactly as a
    ``HostActor`` does, so the other paths differ from this one only by their hops."""
    import torch

    from meshserve.engine.engine import EngineCore

    torch.set_num_threads(os.cpu_count() or 1)  # as HostActor does
    engine = EngineCore(config)
    samples: list[Sample] = []

    def submit(prompt: list[int]) -> Iterable[int]:
        engine.add_request(uuid.uuid4().hex, prompt, params)
        while engine.has_unfinished:
            yield sum(len(d.token_ids) for d in engine.step())

    thread = threading.Thread(target=lambda: samples.extend(measure(submit, prompts)))
    thread.start()
    thread.join()
    return samples


def run_host_actor(config, prompts: list[list[int]], params) -> list[Sample]:
    import ray

    from meshserve.actors import start_host

    host = start_host(config)

    def submit(prompt: list[int]) -> Iterable[int]:
        stream = host.generate_stream.options(num_returns="streaming").remote(prompt, params)
        for ref in stream:
            yield sum(len(d.token_ids) for d in ray.get(ref))

    try:
        return measure(submit, prompts)
    finally:
        ray.kill(host)


def run_router(settings, prompts: list[list[int]], params) -> list[Sample]:
    from ray import serve

    from meshserve.actors import GenerateSpec
    from meshserve.deploy.app import build_app

    with socket.socket() as s:  # any free port: HTTP is not measured here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app(settings), name="meshserve", route_prefix="/", blocking=False)
    router = serve.get_deployment_handle("Router", app_name="meshserve")
    while not router.ready.remote().result():
        time.sleep(0.5)

    def submit(prompt: list[int]) -> Iterable[int]:
        spec = GenerateSpec(uuid.uuid4().hex, tuple(prompt), params)
        for batch in router.options(stream=True).generate_stream.remote(spec):
            yield sum(len(d.token_ids) for d in batch)

    try:
        return measure(submit, prompts)
    finally:
        serve.shutdown()


def measure(submit: Callable[[list[int]], Iterable[int]], prompts: list[list[int]]) -> list[Sample]:
    timed(lambda: submit(prompts[0]))  # warm-up: first-call costs are not the steady state
    return [timed(lambda p=p: submit(p)) for p in prompts]


def summarize(samples: list[Sample]) -> dict[str, Any]:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [s.tpot_s * 1000 for s in samples]
    return {"ttft_ms": {"median": round(statistics.median(ttft), 2),
                        "mean": round(statistics.fmean(ttft), 2)},
            "tpot_ms": {"median": round(statistics.median(tpot), 3),
                        "mean": round(statistics.fmean(tpot), 3)},
            "samples": [asdict(s) for s in samples]}


def plot(report: dict[str, Any], path: Path) -> None:
    paths, config, machine = report["paths"], report["config"], report["machine"]
    bar_chart(path, ["time to first token", "time per output token"],
              {name: [paths[name]["ttft_ms"]["median"], paths[name]["tpot_ms"]["median"]]
               for name in PATHS},
              title=f"{config['model']}: one request at a time, {config['max_tokens']} tokens, "
                    f"medians\nCPU figures ({machine['cpu_count']} cores, no accelerator)",
              ylabel="milliseconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder or .gguf (default: the bundled model)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/router_latency.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import ray

    from meshserve import SamplingParams
    from meshserve.deploy.settings import ServeSettings
    from meshserve.runner.loader import load_tokenizer

    # One engine shape for every path: the router's settings build the others' EngineConfig.
    settings = ServeSettings.from_args({"model": args.model, "device": "cpu",
                                        "num_kv_blocks": 256, "max_num_seqs": 8})
    config = settings.engine
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer.encode(p) for p in build_prompts(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    load_before = os.getloadavg()  # other work on the machine shows up directly in the figures
    results = {"engine": summarize(run_engine(config, prompts, params))}  # before Ray starts
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        results["host actor"] = summarize(run_host_actor(config, prompts, params))
        results["router"] = summarize(run_router(settings, prompts, params))
    finally:
        ray.shutdown()

    base = results["engine"]
    added = {path: {"ttft_ms": round(r["ttft_ms"]["median"] - base["ttft_ms"]["median"], 2),
                    "tpot_ms": round(r["tpot_ms"]["median"] - base["tpot_ms"]["median"], 3)}
             for path, r in results.items() if path != "engine"}
    info = machine_info()
    report = {
        "benchmark": "router_latency",
        "figures": "CPU",  # device="cpu" on every path, whatever the machine has
        "machine": info,
        "config": {"model": settings.model_name(), "device": "cpu", "dtype": config.dtype,
                   "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                   "concurrency": 1, "prompt_tokens": [len(p) for p in prompts]},
        "load_average_1m": {"start": round(load_before[0], 2),
                            "end": round(os.getloadavg()[0], 2)},
        "paths": results,
        "added_over_engine_median": added,
    }
    write_json(args.output, report)
    chart = args.output.with_suffix(".png")
    plot(report, chart)
    print(f"{'path':<12} {'TTFT ms':>9} {'TPOT ms':>9} {'+TTFT ms':>9} {'+TPOT ms':>9}")
    for path in PATHS:
        r, a = results[path], added.get(path, {"ttft_ms": 0.0, "tpot_ms": 0.0})
        print(f"{path:<12} {r['ttft_ms']['median']:>9.2f} {r['tpot_ms']['median']:>9.3f} "
              f"{a['ttft_ms']:>9.2f} {a['tpot_ms']:>9.3f}")
    print(f"CPU figures; wrote {args.output} and {chart}")


if __name__ == "__main__":
    main()
