"""Shared helpers for the benchmarks: machine facts, memory readings, JSON results and bar charts.

Every benchmark writes one JSON result and a PNG chart beside it (same stem). The figures these
scripts produce on a machine without an accelerator are CPU figures and are labelled as such.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """Return the CPU's model name from /proc/cpuinfo, or what ``platform`` knows elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """Return the repository's HEAD commit, with ``-dirty`` when the working tree has changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_version(name: str) -> str | None:
    """Return an installed distribution's version without importing it, or None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts that qualify a benchmark figure: the CPU, memory, library versions and commit."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "meshserve_commit": git_commit(),
    }


def memory_mib() -> dict[str, float]:
    """This process's current RSS and its peak RSS so far (``ru_maxrss``), in MiB."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
            "peak_rss_mib": round(peak_kib / 2**10, 1)}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating the parent folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def bar_chart(path: Path, groups: list[str], series: dict[str, list[float | None]], *,
              title: str, ylabel: str) -> None:
    """Save a grouped bar chart: one group per entry of ``groups``, one bar per series.

    A None value leaves its bar out (e.g. an engine that was skipped).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        present = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not present:
            continue
        bars = ax.bar([x for x, _ in present], [v for _, v in present], width, label=name)
        ax.bar_label(bars, fmt="%.0f", padding=2, fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, 75), fontsize=10)  # a long title would run off the figure
    ax.legend()
    ax.margins(y=0.15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_model_pieces(runner: Any) -> list[float]:
    """Record, per step, the seconds ``runner`` spends in its model pieces (forward, logits,
    sampling, up to the tokens on the host); the rest of a step is host work."""
    pieces = runner.run_pieces
    seconds: list[float] = []

    def timed(prepared):
        start = time.perf_counter()
        out, hidden = pieces(prepared)
        out.token_ids.cpu()
        seconds.append(time.perf_counter() - start)
        return out, hidden

    runner.run_pieces = timed
    return seconds
