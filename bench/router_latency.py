"""Router latency: what meshserve's routing and HTTP edge add to one engine's latency, against what
a bare Ray Serve SSE deployment of the same engine adds.

The same greedy requests (ignore_eos, one at a time, so nothing queues) go five ways, each on its
own engine of the same model and settings, on a local Ray bound to 127.0.0.1. Every path is up
before the first request, and each prompt goes down every path in turn (the order rotating from
prompt to prompt): on a shared VM the machine drifts within minutes by as much as the costs
measured here, so paths measured one after another would compare the drift.

- ``engine``: an ``EngineCore`` in this process, stepped by hand in a thread as a host actor
  steps its own: the floor.
- ``host actor``: a ``HostActor`` called through Ray (``generate_stream``): the actor hop.
- ``engine handle``: meshserve's ``Engine`` deployment through an ``EngineClient``, as the HTTP
  ingress calls it: the handle's ``EngineRouter``, ``submit``, the caller's one output stream.
- ``meshserve http``: the whole application over HTTP (server-sent events) as ``meshserve serve``
  runs it: an ingress replica listening itself (tokenizer, text, SSE) and an engine replica.
- ``meshserve via proxy``: the same behind Serve's proxy (``--edge proxy``, as on KubeRay).
- ``bare serve sse``: one Serve deployment that owns the same engine in its process and streams
  server-sent events from it, behind Serve's proxy: what serving this engine over Ray Serve HTTP
  costs at the least. meshserve's edge should add no more than it does.

Per request it records the time to the first token or first text event (TTFT, from submission)
and the time per output token after it (TPOT); it reports medians and what each path adds to the
engine's. On a machine without an accelerator these are CPU figures.

    .venv/bin/python bench/router_latency.py [--num-requests 16] [--max-tokens 32]
        [--model PATH] [--output bench/results/router_latency.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from common import REPO_ROOT, bar_chart, machine_info, write_json  # noqa: E402
from offline import build_prompts  # noqa: E402

PATHS = ("engine", "host actor", "engine handle", "meshserve http", "meshserve via proxy",
         "bare serve sse")


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


Submit = Callable[[int], Iterable[int]]  # request i of the run -> tokens per arrival


def measure(paths: dict[str, Submit], count: int) -> dict[str, list[Sample]]:
    """Request i goes down every path before request i + 1 does, starting at a different path
    each time; one warm-up request per path first (first-call costs are not the steady state)."""
    names = list(paths)
    for name in names:
        timed(lambda: paths[name](0))
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for index in range(count):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timed(lambda: paths[name](index)))
    return samples


class EngineThread:
    """The floor: an engine built and stepped by hand in a thread of its own, exactly as a
    ``HostActor`` builds and steps its engine, so the other paths differ from this one only by
    their hops. Requests reach the thread through a queue."""

    def __init__(self, config, params) -> None:
        self.params = params
        self.jobs: queue.Queue = queue.Queue()
        built: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, args=(config, built), daemon=True).start()
        failure = built.get()
        if failure is not None:
            raise failure

    def _serve(self, config, built: queue.Queue) -> None:
        import torch

        from meshserve.engine.engine import EngineCore

        torch.set_num_threads(os.cpu_count() or 1)  # as HostActor does
        try:
            engine = EngineCore(config)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor to raise
            built.put(exc)
            return
        built.put(None)
        while True:
            prompt, arrivals = self.jobs.get()
            engine.add_request(uuid.uuid4().hex, prompt, self.params)
            while engine.has_unfinished:
                arrivals.put(sum(len(d.token_ids) for d in engine.step()))
            arrivals.put(None)

    def submit(self, prompt: list[int]) -> Iterable[int]:
        arrivals: queue.Queue = queue.Queue()
        self.jobs.put((prompt, arrivals))
        while (count := arrivals.get()) is not None:
            yield count


def host_actor_path(config, params, stack: ExitStack) -> Callable[[list[int]], Iterable[int]]:
    import ray

    from meshserve.actors import start_host

    host = start_host(config)
    stack.callback(ray.kill, host)

    def submit(prompt: list[int]) -> Iterable[int]:
        stream = host.generate_stream.options(num_returns="streaming").remote(prompt, params)
        for ref in stream:
            yield sum(len(d.token_ids) for d in ray.get(ref))

    return submit


class _Loop:
    """An event loop in a thread of its own, to drive async clients from ``measure``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def iterate(self, agen) -> Iterable:
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(agen.__anext__(), self.loop).result()
            except StopAsyncIteration:
                return


def engine_handle_path(settings, params,
                       stack: ExitStack) -> Callable[[list[int]], Iterable[int]]:
    from ray import serve

    from meshserve.actors import GenerateSpec
    from meshserve.deploy.app import engine_deployment
    from meshserve.deploy.client import EngineClient

    handle = serve.run(engine_deployment(settings), name="latency-engine", route_prefix=None)
    stack.callback(serve.delete, "latency-engine")
    loop = _Loop()
    client = asyncio.run_coroutine_threadsafe(_make_client(EngineClient, handle), loop.loop)
    client = client.result()

    def submit(prompt: list[int]) -> Iterable[int]:
        spec = GenerateSpec(uuid.uuid4().hex, tuple(prompt), params)
        for batch in loop.iterate(client.stream(spec)):
            yield sum(len(d.token_ids) for d in batch)

    return submit


async def _make_client(cls, handle):
    await handle.info.remote()  # the handle's router has the replica
    return cls(handle)


def _sse_counts(url: str, body: dict) -> Iterable[int]:
    """Yield 1 per server-sent event that carries text (one token each, greedy and eos ignored)."""
    import httpx

    with httpx.stream("POST", url, json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if any(c.get("text") for c in event.get("choices", ())):
                    yield 1


def http_path(settings, max_tokens: int, port: int, stack: ExitStack,
              listen: bool) -> Callable[[str], Iterable[int]]:
    """The application on ``port``: its ingress listening there itself (``listen``), or behind
    Serve's proxy, which listens there."""
    from ray import serve

    from meshserve.deploy.app import application

    name = "meshserve" if listen else "meshserve-proxied"
    serve.run(application(settings, ("127.0.0.1", port) if listen else None), name=name,
              route_prefix=None if listen else "/")
    stack.callback(serve.delete, name)
    url = f"http://127.0.0.1:{port}/v1/completions"

    def submit(text: str) -> Iterable[int]:
        return _sse_counts(url, {"model": settings.model_name(), "prompt": text,
                                 "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                 "stream": True})

    return submit


def bare_sse_path(settings, max_tokens: int, port: int,
                  stack: ExitStack) -> Callable[[str], Iterable[int]]:
    """The reference: the engine inside one Serve deployment that answers with SSE itself."""
    from ray import serve

    deployment = serve.deployment(BareSSE, name="BareSSE",
                                  ray_actor_options={"num_cpus": settings.placement.host_num_cpus})
    serve.run(deployment.bind(settings.engine), name="bare", route_prefix="/bare")
    stack.callback(serve.delete, "bare")
    url = f"http://127.0.0.1:{port}/bare"

    def submit(text: str) -> Iterable[int]:
        return _sse_counts(url, {"prompt": text, "max_tokens": max_tokens})

    return submit


class BareSSE:
    """What serving one engine over Ray Serve HTTP takes at the least: tokenize, stream deltas from
    the engine (a ``HostActor`` in this process, as meshserve's engine replicas hold theirs),
    decode each token, write an SSE event."""

    def __init__(self, config) -> None:
        from meshserve.actors.host import HostActor
        from meshserve.runner.loader import load_tokenizer

        self.host = HostActor(config)
        self.tokenizer = load_tokenizer(config.model)

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        from meshserve.contracts.sampling import SamplingParams

        body = await request.json()
        ids = self.tokenizer.encode(body["prompt"])
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True)

        async def events():
            async for batch in self.host.generate_stream(ids, params):
                for delta in batch:
                    text = self.tokenizer.decode(list(delta.token_ids))
                    yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def summarize(samples: list[Sample]) -> dict[str, Any]:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [s.tpot_s * 1000 for s in samples]
    return {"ttft_ms": {"median": round(statistics.median(ttft), 2),
                        "mean": round(statistics.fmean(ttft), 2)},
            "tpot_ms": {"median": round(statistics.median(tpot), 3),
                        "mean": round(statistics.fmean(tpot), 3)},
            "samples": [asdict(s) for s in samples]}


def plot(report: dict[str, Any], path: Path) -> None:
    added, config, machine = report["added_over_engine_median"], report["config"], report["machine"]
    names = [p for p in PATHS if p in added]
    bar_chart(path, ["added to the first token (ms)", "added per output token (ms, x10)"],
              {name: [added[name]["ttft_ms"], added[name]["tpot_ms"] * 10] for name in names},
              title=f"{config['model']}: one request at a time, {config['max_tokens']} tokens, "
                    f"medians over the engine's own\nCPU figures ({machine['cpu_count']} cores, "
                    "no accelerator)",
              ylabel="milliseconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder or .gguf (default: the bundled model)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/router_latency.json")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import ray
    from ray import serve

    from meshserve import SamplingParams
    from meshserve.deploy.settings import ServeSettings
    from meshserve.runner.loader import load_tokenizer

    # One engine shape for every path: the application's settings build the others' EngineConfig.
    settings = ServeSettings.from_args({"model": args.model, "device": "cpu",
                                        "num_kv_blocks": 256, "max_num_seqs": 8})
    config = settings.engine
    tokenizer = load_tokenizer(args.model)
    texts = build_prompts(args.num_requests)
    prompts = [tokenizer.encode(p) for p in texts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    load_before = os.getloadavg()  # other work on the machine shows up directly in the figures
    floor = EngineThread(config, params)
    # Five engines and two ingresses wait side by side, each reserving logical CPUs; only the
    # request in flight computes, so Ray is told of more CPUs than the machine has.
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=16)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    with ExitStack() as stack:
        stack.callback(ray.shutdown)
        stack.callback(serve.shutdown)
        by_ids = {"engine": floor.submit,
                  "host actor": host_actor_path(config, params, stack),
                  "engine handle": engine_handle_path(settings, params, stack)}
        by_text = {"meshserve http": http_path(settings, args.max_tokens, _free_port(), stack,
                                               listen=True),
                   "meshserve via proxy": http_path(settings, args.max_tokens, port, stack,
                                                    listen=False),
                   "bare serve sse": bare_sse_path(settings, args.max_tokens, port, stack)}
        paths: dict[str, Submit] = {
            **{name: (lambda i, f=f: f(prompts[i])) for name, f in by_ids.items()},
            **{name: (lambda i, f=f: f(texts[i])) for name, f in by_text.items()}}
        samples = measure(paths, len(prompts))
    results = {path: summarize(samples[path]) for path in PATHS}

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
                   "concurrency": 1, "order": "interleaved: request i down every path in turn",
                   "prompt_tokens": [len(p) for p in prompts]},
        "load_average_1m": {"start": round(load_before[0], 2),
                            "end": round(os.getloadavg()[0], 2)},
        "paths": results,
        "added_over_engine_median": added,
        # The edge's target: meshserve over HTTP adds no more than the bare deployment.
        "meshserve_minus_bare_ms": {
            k: round(added["meshserve http"][k] - added["bare serve sse"][k], 3)
            for k in ("ttft_ms", "tpot_ms")},
        "meshserve_via_proxy_minus_bare_ms": {
            k: round(added["meshserve via proxy"][k] - added["bare serve sse"][k], 3)
            for k in ("ttft_ms", "tpot_ms")},
    }
    write_json(args.output, report)
    chart = args.output.with_suffix(".png")
    plot(report, chart)
    print(f"{'path':<20} {'TTFT ms':>9} {'TPOT ms':>9} {'+TTFT ms':>9} {'+TPOT ms':>9}")
    for path in PATHS:
        r, a = results[path], added.get(path, {"ttft_ms": 0.0, "tpot_ms": 0.0})
        print(f"{path:<20} {r['ttft_ms']['median']:>9.2f} {r['tpot_ms']['median']:>9.3f} "
              f"{a['ttft_ms']:>9.2f} {a['tpot_ms']:>9.3f}")
    print(f"meshserve http minus bare serve sse: {report['meshserve_minus_bare_ms']}")
    print(f"CPU figures; wrote {args.output} and {chart}")


if __name__ == "__main__":
    main()
