"""The edge processes yield the CPU to the engines; the engines' OpenMP threads keep theirs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshserve.deploy.settings import ServeSettings

# Runs in its own process: niceness can be raised but never lowered again without privileges.
_LOWER = """
import json, os, threading
from meshserve.deploy.settings import ServeSettings

def nice(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)

started, release = threading.Event(), threading.Event()
tids = []
def worker():
    tids.append(threading.get_native_id())
    started.set()
    release.wait()
thread = threading.Thread(target=worker)
thread.start()
started.wait()
main = threading.get_native_id()
before = {"main": nice(main), "worker": nice(tids[0])}
ServeSettings(edge_nice=int(os.environ["EDGE_NICE"])).lower_priority()
later = []
child = threading.Thread(target=lambda: later.append(nice(threading.get_native_id())))
child.start(); child.join()
after = {"main": nice(main), "worker": nice(tids[0]), "started_after": later[0]}
release.set(); thread.join()
print(json.dumps({"before": before, "after": after}))
"""


def _lowered(edge_nice: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _LOWER], capture_output=True, text=True,
                          env={"EDGE_NICE": str(edge_nice), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lower_priority_lowers_every_thread_of_the_process() -> None:
    # Linux keeps a niceness per thread: Ray's event loop and I/O threads exist before the
    # replica's constructor runs, and must be lowered with it.
    seen = _lowered(5)
    base = seen["before"]["main"]
    assert seen["before"]["worker"] == base
    expected = min(19, base + 5)
    assert seen["after"] == {"main": expected, "worker": expected, "started_after": expected}


def test_edge_nice_zero_leaves_the_process_alone() -> None:
    seen = _lowered(0)
    assert set(seen["after"].values()) == {seen["before"]["main"]}


@pytest.mark.parametrize("policy, env", [("default", {}),
                                         ("passive", {"OMP_WAIT_POLICY": "PASSIVE"}),
                                         ("active", {"OMP_WAIT_POLICY": "ACTIVE"})])
def test_hosts_start_with_the_chosen_openmp_wait_policy(policy: str, env: dict) -> None:
    assert ServeSettings(omp_wait_policy=policy).host_env() == env


def test_hosts_keep_the_openmp_runtimes_wait_policy_by_default() -> None:
    # PASSIVE made both engine threads sleep after every parallel region: 17% slower on 2 cores.
    assert ServeSettings().host_env() == {}


def test_invalid_edge_settings_are_named() -> None:
    with pytest.raises(ValueError, match="omp_wait_policy"):
        ServeSettings(omp_wait_policy="spin")
    with pytest.raises(ValueError, match="edge_nice"):
        ServeSettings(edge_nice=20)
