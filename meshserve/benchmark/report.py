"""A run for people: a table on the terminal, and a JSON report with a latency chart beside it.

The machine info in the JSON describes the client, not the server.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from meshserve.benchmark.results import PERCENTILES, BenchResult


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
