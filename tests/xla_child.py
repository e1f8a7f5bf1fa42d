"""Running a test module's XLA jobs in a child interpreter.

torch_xla fixes the number of virtual devices (``CPU_NUM_DEVICES``) when it starts, and SPMD needs
a mesh over all of them, so each group of jobs runs in a fresh ``python -m tests.<module>`` that
reads the jobs as JSON on stdin and prints its report as the last line of stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_xla_child(module: str, devices: int, jobs: list[dict], timeout: float,
                  env: dict[str, str] | None = None) -> dict:
    """Run ``jobs`` in ``python -m module`` on ``devices`` PJRT CPU devices; return its report,
    after checking that every op it ran lowered to XLA (no hidden CPU round trips)."""
    child_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
                     TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", module], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=REPO, env=child_env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["fallback_ops"] == []
    return report
