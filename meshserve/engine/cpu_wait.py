"""``cpu_wait_seconds``: how long the calling thread has waited for a CPU while ready to run.

An engine's step runs on every core it owns, its OpenMP threads meeting at a barrier after each
kernel; when another process takes a core from one of them, the others wait for it at the next
barrier. The time the stepping thread spent runnable but not running (Linux's per-thread
``schedstat``, kept by the scheduler whether or not schedstats are enabled) is the direct measure
of that: a quiet machine keeps it near zero, and a step that got slower only in the server shows
here what the processes beside the engine took from it.
"""

from __future__ import annotations

SCHEDSTAT = "/proc/thread-self/schedstat"  # "<ns on a CPU> <ns runnable, waiting> <timeslices>"


def cpu_wait_seconds() -> float | None:
    """Seconds this thread has waited on a run queue since it started; None where the kernel
    does not say (not Linux)."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
