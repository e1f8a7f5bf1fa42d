"""A run for people: a table on the terminal, and a JSON report with a latency chart beside it;
with a peer's run of the same workload, both in one report and one chart, and their ratios; with
several rounds, every round's figures and the medians of their ratios.

The machine info in the JSON describes the client, not the server.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Any, Sequence

import numpy as np

from meshserve.benchmark.results import PERCENTILES, BenchResult, RequestResult, Round


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


def _request_record(request: RequestResult) -> dict[str, Any]:
    """One request's measurements, times in seconds to the microsecond: the digits beyond are the
    clock's noise, and a report of a thousand streamed requests would be mostly those."""
    def us(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds, 6)

    return {**asdict(request), "e2e": us(request.e2e), "ttft": us(request.ttft),
            "itl": [us(gap) for gap in request.itl], "tpot": us(request.tpot)}


def _run_record(result: BenchResult) -> dict[str, Any]:
    config = asdict(result.config)
    config["api_key"] = "<set>" if config["api_key"] else None  # never write a secret to disk
    return {"config": config, "results": result.summary(),
            "requests": [_request_record(r) for r in result.requests]}


def compare(result: BenchResult, peer: BenchResult) -> dict[str, float | None]:
    """How ``result`` stands against ``peer``: throughput as a ratio (above 1 is faster), and
    TTFT / TPOT medians as ratios (below 1 is quicker)."""
    ours, theirs = result.summary(), peer.summary()

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    return {"output_throughput": ratio(ours["output_throughput"], theirs["output_throughput"]),
            "ttft_p50": ratio(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
            "tpot_p50": ratio(ours["tpot_ms"]["p50"], theirs["tpot_ms"]["p50"])}


def median_comparison(rounds: Sequence[Round]) -> dict[str, float | None]:
    """Each ratio of ``compare`` as its median over the rounds that have it: on a machine whose
    speed drifts, rounds that alternate which server goes first cancel the drift out."""
    ratios = [compare(r.ours, r.peer) for r in rounds if r.peer is not None]
    if not ratios:
        raise ValueError("median_comparison needs rounds with a peer")

    def middle(key: str) -> float | None:
        values = [c[key] for c in ratios if c[key] is not None]
        return round(median(values), 3) if values else None

    return {key: middle(key) for key in ratios[0]}


def _ratios(c: dict[str, float | None]) -> str:
    cells = {k: "n/a" if v is None else f"{v:.2f}x" for k, v in c.items()}
    return (f"output throughput {cells['output_throughput']}, TTFT p50 {cells['ttft_p50']}, "
            f"TPOT p50 {cells['tpot_p50']}")


def format_comparison(result: BenchResult, peer: BenchResult,
                      rounds: Sequence[Round] = ()) -> str:
    """One line: ``result`` against ``peer``; with ``rounds``, the medians of their ratios."""
    if rounds:
        return (f"{result.config.url} against {peer.config.url}, medians of {len(rounds)} "
                f"rounds: {_ratios(median_comparison(rounds))}")
    return f"{result.config.url} against {peer.config.url}: {_ratios(compare(result, peer))}"


def format_round(index: int, total: int, run: Round) -> str:
    """A progress line for round ``index`` (from 0) of ``total``."""
    ours = run.ours.summary()["output_throughput"]
    head = f"round {index + 1}/{total} (seed {run.ours.config.seed}"
    if run.peer is None:
        return f"{head}): {ours:.1f} tok/s"
    first = run.peer.config.url if run.peer_first else run.ours.config.url
    return (f"{head}, {first} first): {ours:.1f} against "
            f"{run.peer.summary()['output_throughput']:.1f} tok/s; "
            f"{_ratios(compare(run.ours, run.peer))}")


def _round_record(run: Round) -> dict[str, Any]:
    record: dict[str, Any] = {"seed": run.ours.config.seed, "results": run.ours.summary()}
    if run.peer is not None:
        record["first"] = run.peer.config.url if run.peer_first else run.ours.config.url
        record["peer_results"] = run.peer.summary()
        record["comparison"] = compare(run.ours, run.peer)
    return record


def write_report(result: BenchResult, path: str | Path, peer: BenchResult | None = None,
                 rounds: Sequence[Round] = ()) -> tuple[Path, Path]:
    """Write the JSON result and a PNG of the latency distributions beside it (same stem). With
    ``peer`` (the same workload on another server, run right after), both runs go in one report
    and one chart, with the ratios between them. With ``rounds`` (``bench serve --rounds``),
    ``result`` and ``peer`` are the rounds' runs pooled (``results.pooled``), the report lists
    every round under ``rounds``, and its ``comparison`` is the medians of the rounds' ratios."""
    json_path = Path(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if peer is None:
        report = _run_record(result)
    else:
        report = {"runs": [_run_record(result), _run_record(peer)],
                  "comparison": median_comparison(rounds) if rounds else compare(result, peer)}
    if rounds:
        report["rounds"] = [_round_record(r) for r in rounds]
    report["machine"] = machine_info()
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    png_path = json_path.with_suffix(".png")
    _plot([result] if peer is None else [result, peer], png_path, len(rounds))
    return json_path, png_path


def _plot(results: list[BenchResult], path: Path, num_rounds: int = 0) -> None:
    # Imported here: matplotlib is an optional extra and slow to import. The Agg canvas renders
    # without a display and leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 4), layout="constrained")
    FigureCanvasAgg(figure)
    metrics = (("TTFT", lambda r: r.ttft), ("TPOT", lambda r: r.tpot),
               ("End to end", lambda r: r.e2e))
    for axes, (name, value) in zip(figure.subplots(1, 3), metrics):
        counts = []
        for result in results:
            values = np.sort([value(r) * 1000 for r in result.completed if value(r) is not None])
            counts.append(str(values.size))
            if values.size:
                line = axes.step(values, np.arange(1, values.size + 1) / values.size,
                                 where="post", label=result.config.url)[0]
                for q in PERCENTILES:
                    axes.axvline(np.percentile(values, q), linestyle=":", color=line.get_color())
        measured = any(int(n) for n in counts)
        if not measured:
            axes.text(0.5, 0.5, "not measured", ha="center", transform=axes.transAxes)
        axes.set_title(f"{name} CDF ({' / '.join(counts)} requests)")
        axes.set_xlabel(f"{name} (ms); dotted lines: p50, p90, p99")
        axes.set_ylabel("fraction of requests")
        axes.grid(alpha=0.3)
        if len(results) > 1 and measured:
            axes.legend(fontsize=8, loc="lower right")
    c = results[0].config
    servers = " vs ".join(f"{r.config.model} at {r.config.url}" for r in results)
    figure.suptitle(f"{servers}\nconcurrency {c.concurrency}, "
                    f"{'streaming' if c.stream else 'non-streaming'}, max_tokens {c.max_tokens}"
                    + (f", {num_rounds} rounds pooled" if num_rounds > 1 else ""))
    figure.savefig(path, dpi=100)
