"""One run's configuration and measurements, and the statistics derived from them.

Plain data: a run (``BenchResult``) keeps every request's own measurements and derives the
aggregates on demand, so a summary can never disagree with the requests behind it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
MAX_REPORTED_ERRORS = 5


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


def pooled(runs: Sequence[BenchResult]) -> BenchResult:
    """Several runs of one server as one: every request, over the sum of their durations (so
    its throughput is all their tokens over all their time). The first run's config names it."""
    if not runs:
        raise ValueError("pooled needs at least one run")
    return BenchResult(config=runs[0].config, duration=sum(r.duration for r in runs),
                       requests=tuple(q for r in runs for q in r.requests))


@dataclass(frozen=True, slots=True)
class Round:
    """One round of ``bench serve --rounds``: a server's run and, with ``--compare``, the peer's
    run of the same prompts; ``peer_first`` says which of the two went first."""

    ours: BenchResult
    peer: BenchResult | None = None
    peer_first: bool = False
