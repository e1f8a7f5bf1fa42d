"""Serving benchmark for any OpenAI-compatible server: ``meshserve bench serve``.

It sends ``num_prompts`` completion requests with at most ``concurrency`` in flight and reports
latency (time to first token, time per output token, inter-token gaps, end to end) and throughput.
``client.run(client.run_benchmark(results.BenchConfig(...)))`` is the programmatic entry.

Modules: ``results`` (a run's configuration, measurements and statistics), ``prompts``,
``stream`` (server-sent events and the timing of one stream), ``client`` (HTTP, the one module
that needs aiohttp), ``report`` (table, JSON and chart) and ``cli``. Nothing is imported here, so
that registering the subcommand loads none of them.
"""
