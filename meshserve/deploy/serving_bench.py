"""Serving benchmark for any OpenAI-compatible server: ``meshserve bench serve``.

It sends ``num_prompts`` completion requests with at most ``concurrency`` in flight and reports
latency (time to first token, time per output token, inter-token gaps, end to end) and throughput.
It speaks only the public ``/v1/completions`` protocol, so the same command measures meshserve and
a peer such as vLLM on the same prompts. ``run_benchmark(BenchConfig(...))`` is the programmatic
entry; ``add_bench_parser`` registers the CLI subcommand.

Timings are taken on the client: they include the network and the server's HTTP layer, which is
what a user sees. The machine info in the JSON describes the client, not the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import httpx
import numpy as np

PERCENTILES = (50, 90, 99)
MAX_REPORTED_ERRORS = 5

_WORDS = (
    "the river city night morning garden machine letter window mountain story friend music "
    "winter market teacher engine voice forest harbor lantern journey bridge library painter "
    "quietly slowly carefully suddenly always never often bright old small distant warm strange "
    "walks finds builds remembers carries opens watches follows explains answers discovers"
).split()
_TOPICS = (
    "a lighthouse keeper", "the history of bread", "a robot learning to paint", "rain in a desert",
    "an old map", "the first day of school", "a train that never stops", "the life of a bee",
    "a city under the sea", "a letter from the future", "a chess match", "a forgotten song",
)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run. ``url`` is the server root (a trailing ``/v1`` is accepted)."""

    url: str
    model: str
    num_prompts: int = 100
    concurrency: int = 8
    stream: bool = False
    max_tokens: int = 64
    seed: int = 0
    api_key: str | None = None
    timeout: float = 300.0  # seconds for the whole run; also each request's own limit
    dataset: str | None = None  # JSON lines {"prompt": ...}; synthetic prompts when None
    prompt_words: tuple[int, int] = (16, 256)  # synthetic prompt length range, in words

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if not self.model:
            raise ValueError("model must be a non-empty name")
        for name in ("num_prompts", "concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        low, high = self.prompt_words
        if not 1 <= low <= high:
            raise ValueError(f"prompt_words must satisfy 1 <= min <= max, got {self.prompt_words}")

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1") + "/v1/completions"


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request measured; times in seconds from the moment it was sent."""

    ok: bool
    e2e: float
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl: tuple[float, ...] = ()  # gaps between successive streamed chunks that carried text
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; defined only when the first token was timed
        apart from the end (streaming) and more than one token came back."""
        if not self.ok or not self.itl or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and the PERCENTILES (linear interpolation, as numpy's default); None when empty,
    so the JSON stays valid (NaN is not JSON)."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return dict.fromkeys(keys)
    data = np.asarray(values, dtype=np.float64)
    stats = [float(data.mean())] + [float(v) for v in np.percentile(data, PERCENTILES)]
    return dict(zip(keys, stats))


@dataclass(frozen=True, slots=True)
class BenchResult:
    """All requests of one run; the aggregates are derived, never stored twice."""

    config: BenchConfig
    duration: float
    requests: tuple[RequestResult, ...]

    @property
    def completed(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.requests if r.ok)

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The first few distinct error messages, each with how many requests failed so."""
        counts = Counter(r.error or "unknown error" for r in self.requests if not r.ok)
        return [{"message": message, "count": count}
                for message, count in list(counts.items())[:MAX_REPORTED_ERRORS]]

    def summary(self) -> dict[str, Any]:
        """Counts, throughputs and latency percentiles (milliseconds) as plain data."""
        done = self.completed
        output_tokens = sum(r.output_tokens for r in done)
        rate = 1 / self.duration if self.duration > 0 else 0.0

        def ms(values: Iterable[float | None]) -> dict[str, float | None]:
            stats = percentiles([v * 1000 for v in values if v is not None])
            return {k: None if v is None else round(v, 3) for k, v in stats.items()}

        return {
            "completed": len(done),
            "failed": len(self.requests) - len(done),
            "errors": self.errors,
            "duration_s": round(self.duration, 4),
            "request_throughput": round(len(done) * rate, 4),
            "output_tokens": output_tokens,
            "output_throughput": round(output_tokens * rate, 3),
            "ttft_ms": ms(r.ttft for r in done),
            "tpot_ms": ms(r.tpot for r in done),
            "itl_ms": ms(gap for r in done for gap in r.itl),
            "e2e_ms": ms(r.e2e for r in done),
        }


# --- Prompts --------------------------------------------------------------------------------


def synthetic_prompts(count: int, seed: int, words: tuple[int, int] = (16, 256)) -> list[str]:
    """Deterministic English-like prompts whose lengths vary across ``words``. Each opens with a
    distinct numbered request so that no two share a long prefix (prefix caching would
    otherwise flatter the server)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        target = rng.randint(*words)
        text = [f"Request {index}: write about {rng.choice(_TOPICS)}."]
        length = len(text[0].split())
        while length < target:
            sentence = rng.sample(_WORDS, min(rng.randint(5, 12), target - length))
            text.append(" ".join(sentence).capitalize() + ".")
            length += len(sentence)
        prompts.append(" ".join(text))
    return prompts


def load_prompts(config: BenchConfig) -> list[str]:
    """The run's prompts: the dataset's lines in order (repeated if it is short), or synthetic."""
    if config.dataset is None:
        return synthetic_prompts(config.num_prompts, config.seed, config.prompt_words)
    with open(config.dataset, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    pool = [r["prompt"] for r in records
            if isinstance(r, dict) and isinstance(r.get("prompt"), str)]
    if not pool or len(pool) != len(records):
        raise ValueError(f"{config.dataset}: every line must be a JSON object with a string "
                         f"'prompt' ({len(pool)} of {len(records)} are)")
    return [pool[i % len(pool)] for i in range(config.num_prompts)]


# --- Server-sent events ---------------------------------------------------------------------


class SSEDecoder:
    """Incremental server-sent-events parser: bytes in any split, event data strings out.

    Bytes are buffered until a full line arrives, so a chunk boundary inside a multi-byte
    character or between ``\\r`` and ``\\n`` is harmless. Per the SSE spec, ``data:`` lines
    accumulate and a blank line dispatches them; other fields and comments are ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.removesuffix(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


class StreamTimer:
    """Times one streamed completion from its raw bytes: first text chunk, gaps, usage.

    Chunks without text (the usage-only chunk, a bare finish reason) are not tokens, so they
    neither set the TTFT nor add a gap.
    """

    def __init__(self, start: float) -> None:
        self._start = start
        self._decoder = SSEDecoder()
        self._chunk_times: list[float] = []
        self._usage: dict[str, Any] = {}
        self._error: str | None = None
        self._done = False

    def feed(self, chunk: bytes, now: float) -> None:
        for data in self._decoder.feed(chunk):
            if self._done or self._error:
                continue
            if data == "[DONE]":
                self._done = True
                continue
            event = json.loads(data)
            if "error" in event or event.get("object") == "error":
                self._error = f"error event: {json.dumps(event.get('error', event))[:300]}"
            elif any(choice.get("text") for choice in event.get("choices") or ()):
                self._chunk_times.append(now)
            self._usage = event.get("usage") or self._usage

    def result(self, end: float) -> RequestResult:
        e2e = end - self._start
        error = self._error or (None if self._done else "stream ended before data: [DONE]")
        if error:
            return RequestResult(ok=False, e2e=e2e, error=error)
        times = self._chunk_times
        return RequestResult(
            ok=True, e2e=e2e,
            ttft=times[0] - self._start if times else None,
            # Usage is exact; counting chunks is the fallback for servers that ignore
            # stream_options (it undercounts when a chunk carries several tokens).
            output_tokens=self._usage.get("completion_tokens", len(times)),
            prompt_tokens=self._usage.get("prompt_tokens"),
            itl=tuple(b - a for a, b in zip(times, times[1:])))


# --- Running --------------------------------------------------------------------------------


async def _send(client: httpx.AsyncClient, config: BenchConfig, prompt: str) -> RequestResult:
    body = {"model": config.model, "prompt": prompt, "max_tokens": config.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": config.stream}
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    try:
        async with client.stream("POST", config.completions_url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                return RequestResult(ok=False, e2e=time.perf_counter() - start,
                                     error=f"HTTP {response.status_code}: {text[:300]}")
            if not config.stream:
                payload = json.loads(await response.aread())
                e2e = time.perf_counter() - start
                usage = payload.get("usage") or {}
                return RequestResult(ok=True, e2e=e2e, ttft=e2e,
                                     output_tokens=usage.get("completion_tokens", 0),
                                     prompt_tokens=usage.get("prompt_tokens"))
            timer = StreamTimer(start)
            async for chunk in response.aiter_bytes():
                timer.feed(chunk, time.perf_counter())
            return timer.result(time.perf_counter())
    except (httpx.HTTPError, ValueError) as error:  # ValueError: malformed JSON or UTF-8
        return RequestResult(ok=False, e2e=time.perf_counter() - start,
                             error=f"{type(error).__name__}: {error}")


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Send every prompt, at most ``concurrency`` at a time; requests still running when the
    run timeout expires are cancelled and counted as failed."""
    prompts = load_prompts(config)
    semaphore = asyncio.Semaphore(config.concurrency)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency,
                          max_keepalive_connections=config.concurrency)

    async with httpx.AsyncClient(limits=limits, timeout=config.timeout,
                                 headers=headers) as client:
        async def bounded(prompt: str) -> RequestResult:
            async with semaphore:
                return await _send(client, config, prompt)

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(bounded(p)) for p in prompts]
        _, pending = await asyncio.wait(tasks, timeout=config.timeout)
        duration = time.perf_counter() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    timed_out = RequestResult(ok=False, e2e=duration,
                              error=f"not finished within the {config.timeout:g} s run timeout")
    return BenchResult(config=config, duration=duration,
                       requests=tuple(timed_out if t in pending else t.result() for t in tasks))


# --- Reporting ------------------------------------------------------------------------------


def format_table(result: BenchResult) -> str:
    """A human-readable summary of one run."""
    s, c = result.summary(), result.config
    mode = "streaming" if c.stream else "non-streaming (TTFT = end-to-end)"
    rows = [
        ("Server", c.url), ("Model", c.model), ("Mode", f"{mode}, concurrency {c.concurrency}"),
        ("Completed / failed", f"{s['completed']} / {s['failed']}"),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
    ]
    lines = [f"{name:<28}{value}" for name, value in rows]
    lines.append(f"{'(ms)':<28}" + "".join(f"{k:>10}" for k in s["ttft_ms"]))
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                       ("End to end", "e2e_ms")):
        cells = ["n/a" if v is None else f"{v:.1f}" for v in s[key].values()]
        lines.append(f"{label:<28}" + "".join(f"{cell:>10}" for cell in cells))
    lines += [f"error ({e['count']}x): {e['message']}" for e in s["errors"]]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """The client machine: CPUs it has and may use (a container may be limited), platform."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "platform": platform.platform(),
            "python": platform.python_version()}


def write_report(result: BenchResult, path: str | Path) -> tuple[Path, Path]:
    """Write the JSON result and a PNG of the latency distributions beside it (same stem)."""
    json_path = Path(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    config = asdict(result.config)
    config["api_key"] = "<set>" if config["api_key"] else None  # never write a secret to disk
    report = {
        "config": config, "results": result.summary(), "machine": machine_info(),
        "requests": [{**asdict(r), "tpot": r.tpot} for r in result.requests],
    }
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    png_path = json_path.with_suffix(".png")
    _plot(result, png_path)
    return json_path, png_path


def _plot(result: BenchResult, path: Path) -> None:
    # Imported here: matplotlib is an optional extra and slow to import. The Agg canvas renders
    # without a display and leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = result.completed
    series = [("TTFT", [r.ttft for r in done]), ("TPOT", [r.tpot for r in done]),
              ("End to end", [r.e2e for r in done])]
    figure = Figure(figsize=(13, 4), layout="constrained")
    FigureCanvasAgg(figure)
    for axes, (name, raw) in zip(figure.subplots(1, 3), series):
        values = np.sort([v * 1000 for v in raw if v is not None])
        axes.set_title(f"{name} CDF ({len(values)} requests)")
        axes.set_xlabel(f"{name} (ms); dotted lines: p50, p90, p99")
        axes.set_ylabel("fraction of requests")
        if values.size:
            axes.step(values, np.arange(1, values.size + 1) / values.size, where="post")
            for q in PERCENTILES:
                axes.axvline(np.percentile(values, q), linestyle=":", color="grey")
        else:
            axes.text(0.5, 0.5, "not measured", ha="center", transform=axes.transAxes)
        axes.grid(alpha=0.3)
    c = result.config
    figure.suptitle(f"{c.model} at {c.url}: concurrency {c.concurrency}, "
                    f"{'streaming' if c.stream else 'non-streaming'}, max_tokens {c.max_tokens}")
    figure.savefig(path, dpi=100)


# --- CLI ------------------------------------------------------------------------------------


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
