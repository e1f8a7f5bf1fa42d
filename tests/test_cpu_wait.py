"""``cpu_wait_seconds`` counts the time a thread is ready to run while another process holds its
core, the figure /metrics and bench/serving.py report as the engine's CPU wait."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from meshserve.engine.cpu_wait import cpu_wait_seconds

_SPIN = "while True: pass"


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _waited_while_spinning(core: int, seconds: float, beside: bool) -> float:
    """Spin on ``core`` for ``seconds`` of wall time, with or without a process spinning on the
    same core; return how long this thread waited for it. Runs in a thread of its own, whose
    affinity alone is changed."""
    result: list[float] = []

    def run() -> None:
        os.sched_setaffinity(0, {core})  # 0: the calling thread
        hog = None
        if beside:
            hog = subprocess.Popen([sys.executable, "-c", _SPIN],
                                   preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        try:
            if hog is not None:
                deadline = time.monotonic() + 60
                while _cpu_ticks(hog.pid) == 0:  # started and running, not just forked
                    assert time.monotonic() < deadline, "the spinning process never ran"
                    time.sleep(0.01)
            before = cpu_wait_seconds()
            _spin(seconds)
            result.append(cpu_wait_seconds() - before)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_cpu_wait_counts_time_another_process_holds_the_core() -> None:
    core = min(os.sched_getaffinity(0))
    shared = _waited_while_spinning(core, 1.0, beside=True)
    alone = _waited_while_spinning(core, 1.0, beside=False)
    # Two equal spinners on one core share it: about half the second is spent waiting. Alone,
    # the thread waits only for what else this machine runs.
    assert 0.2 < shared < 1.0, shared
    assert alone < shared / 2, (alone, shared)


def test_cpu_wait_is_per_thread() -> None:
    first = cpu_wait_seconds()
    assert first is not None and first >= 0.0
    # Another thread's wait is not this thread's: a thread that shares its core with a spinner
    # waits, while this one, blocked in join, adds no wait at all.
    core = min(os.sched_getaffinity(0))
    assert _waited_while_spinning(core, 0.5, beside=True) > 0.1
    assert cpu_wait_seconds() - first < 0.05
