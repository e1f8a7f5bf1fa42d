"""CPU-seconds spent by each kind of process on this machine over a span of time, from /proc.

A serving benchmark's throughput on a small machine is set by where the cores went: the engine's
threads, the HTTP edge around them (Serve's proxy, the ingress, the controller), Ray's daemons,
the client. ``ProcessCpu`` snapshots every process's user + system time before and after a span
and sums the difference by process kind, so a run reports that split beside its figures. It also
shows machine drift: the engine's CPU-seconds for the same tokens move with the VM's speed.

A process that exits within the span is not counted (its last figures are gone with it). Linux
only (``/proc``); elsewhere it reports nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PYTHONS = ("python", "python3")
MIN_REPORTED_S = 0.05  # processes that used less over the span are left out


def process_kind(argv: list[str], comm: str) -> str:
    """A stable label for a process: Ray workers by their actor (``ray::ServeReplica:app:Name``,
    without the method they happen to run), Python by the module or script it runs, anything
    else by its program name; kernel threads by ``[comm]``."""
    if not argv:
        return f"[{comm}]"
    first = argv[0]
    if first.startswith(("ray::", "VLLM::")):
        return first.split(".", 1)[0]
    program = Path(first).name
    if program.startswith(PYTHONS) and len(argv) > 1:
        if argv[1] == "-c":  # its code is no name
            return f"{program} -c"
        if "-m" in argv[1:-1]:
            return argv[argv.index("-m") + 1]
        script = next((a for a in argv[1:] if not a.startswith("-")), argv[1])
        return Path(script).name
    return program


def parse_stat(stat: str) -> tuple[str, float]:
    """A process's name and CPU-seconds so far, from the text of its ``/proc/<pid>/stat``."""
    comm, _, rest = stat.partition("(")[2].rpartition(")")
    fields = rest.split()
    # fields[11], fields[12]: utime and stime (stat fields 14 and 15), in clock ticks
    return comm, (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def _snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU-seconds so far) for every process that can be read."""
    processes: dict[int, tuple[str, float]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return processes
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        comm, seconds = parse_stat(stat)
        processes[int(entry.name)] = (process_kind([a for a in argv if a], comm), seconds)
    return processes


class ProcessCpu:
    """``with ProcessCpu() as cpu: ...``; then ``cpu.by_kind`` holds CPU-seconds per process
    kind over the block, largest first."""

    def __enter__(self) -> ProcessCpu:
        self._before = _snapshot()
        self.by_kind: dict[str, float] = {}
        return self

    def __exit__(self, *exc_info: object) -> None:
        used: dict[str, float] = {}
        for pid, (kind, seconds) in _snapshot().items():
            # A process started during the span counts from zero.
            delta = seconds - self._before.get(pid, (kind, 0.0))[1]
            if delta > 0:
                used[kind] = used.get(kind, 0.0) + delta
        self.by_kind = {kind: round(s, 1) for kind, s in
                        sorted(used.items(), key=lambda item: -item[1]) if s >= MIN_REPORTED_S}
