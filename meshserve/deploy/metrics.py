"""Prometheus metrics of the HTTP edge, plus engine gauges read from every engine replica at scrape
time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServingMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("meshserve_requests", "Finished requests by status", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("meshserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("meshserve_generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram("meshserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("meshserve_time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TOKEN_BUCKETS,
                              registry=r)
        self.e2e = Histogram("meshserve_e2e_request_latency_seconds", "End-to-end latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("meshserve_http_requests_in_flight", "HTTP requests being served",
                               registry=r)
        self.running = Gauge("meshserve_num_requests_running", "Sequences running on engines",
                             registry=r)
        self.waiting = Gauge("meshserve_num_requests_waiting", "Sequences waiting on engines",
                             registry=r)
        self.kv_usage = Gauge("meshserve_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                              registry=r)
        self.free_blocks = Gauge("meshserve_kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.total_blocks = Gauge("meshserve_kv_cache_total_blocks", "All KV blocks", registry=r)
        self.replicas = Gauge("meshserve_replicas", "Replicas configured", registry=r)
        self.healthy_replicas = Gauge("meshserve_healthy_replicas", "Replicas serving now",
                                      registry=r)
        self.prefix_hits = Gauge("meshserve_prefix_cache_hit_tokens", "Prompt tokens served "
                                 "from the prefix cache", registry=r)
        self.steps = Gauge("meshserve_engine_steps", "Model steps the engines ran", registry=r)
        self.execute_seconds = Gauge("meshserve_engine_execute_seconds", "Seconds the engines "
                                     "spent running model steps, sampling included", registry=r)
        self.cpu_wait_seconds = Gauge(
            "meshserve_engine_cpu_wait_seconds", "Of meshserve_engine_execute_seconds, the seconds "
            "the engines' stepping threads waited for a core other threads or processes held",
            registry=r)

    def started(self) -> None:
        self.in_flight.inc()

    def finished(self, runner, status: str) -> None:
        self.in_flight.dec()
        self.requests.labels(status=status).inc()
        self.prompt_tokens.inc(runner.prompt_tokens)
        self.generation_tokens.inc(runner.completion_tokens)
        end = time.monotonic()
        self.e2e.observe(end - runner.started)
        for choice in runner.choices:
            if choice.first_token_at is None:
                continue
            self.ttft.observe(choice.first_token_at - runner.started)
            if len(choice.token_ids) > 1:
                self.tpot.observe((end - choice.first_token_at) / (len(choice.token_ids) - 1))

    def render(self, replicas: list[dict], configured: int) -> bytes:
        """The metrics, with engine gauges from ``replicas`` (each an ``Engine.stats`` answer:
        the replicas that answered) out of ``configured``."""
        self.replicas.set(configured)
        self.healthy_replicas.set(len(replicas))
        engines = [r["engine"] for r in replicas]
        self.running.set(sum(e["num_running"] for e in engines))
        self.waiting.set(sum(e["num_waiting"] for e in engines))
        total = sum(e["num_total_blocks"] for e in engines)
        free = sum(e["num_free_blocks"] for e in engines)
        self.free_blocks.set(free)
        self.total_blocks.set(total)
        self.kv_usage.set((total - free) / total if total else 0.0)
        self.prefix_hits.set(sum(e["prefix_cache_hit_tokens"] for e in engines))
        self.steps.set(sum(e["num_steps"] for e in engines))
        self.execute_seconds.set(sum(e["execute_seconds"] for e in engines))
        self.cpu_wait_seconds.set(sum(e["cpu_wait_seconds"] for e in engines))
        return generate_latest(self.registry)
