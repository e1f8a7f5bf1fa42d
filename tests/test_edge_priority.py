"""The edge processes yield the CPU to the engines; the engines' OpenMP threads keep theirs, and
with ``reserved_cpus`` run on CPUs of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshserve.actors.cpus import split_cpus
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


def _report(script: str, env: dict[str, str]) -> dict:
    """Run ``script`` in a fresh interpreter with ``env``; the JSON it printed last."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _lowered(edge_nice: int) -> dict:
    return _report(_LOWER, {"EDGE_NICE": str(edge_nice), "PATH": "/usr/bin:/bin"})


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
    with pytest.raises(ValueError, match="reserved_cpus: must be an integer >= 0, got -1"):
        ServeSettings(reserved_cpus=-1)


def test_the_engine_leaves_the_first_cpus_to_the_serving_processes() -> None:
    assert split_cpus(0, {3, 1}) == (1, 3)
    assert split_cpus(1, {0, 1, 2, 3}) == (1, 2, 3)
    assert split_cpus(2, {4, 6, 8}) == (8,)
    message = r"reserved_cpus: must be an integer from 0 to 3 on this host \(4 CPUs\), got 4"
    with pytest.raises(ValueError, match=message):
        split_cpus(4, {0, 1, 2, 3})
    with pytest.raises(ValueError, match="got -1"):
        split_cpus(-1, {0, 1})


# The engine's thread claims its CPUs; threads it starts afterwards (as its OpenMP team is, at
# the first parallel region) inherit the pin, and the process's other threads keep every CPU.
_CLAIM = """
import json, os, threading, torch
from meshserve.actors.cpus import claim_engine_cpus

allowed = sorted(os.sched_getaffinity(0))
seen = {"allowed": allowed}
def engine():
    seen["claimed"] = list(claim_engine_cpus(int(os.environ["RESERVED"])))
    seen["torch_threads"] = torch.get_num_threads()
    seen["engine"] = sorted(os.sched_getaffinity(0))
    child = threading.Thread(target=lambda: seen.update(child=sorted(os.sched_getaffinity(0))))
    child.start(); child.join()
thread = threading.Thread(target=engine)
thread.start(); thread.join()
seen["main"] = sorted(os.sched_getaffinity(0))
print(json.dumps(seen))
"""


def _claimed(reserved: int) -> dict:
    return _report(_CLAIM, {**os.environ, "RESERVED": str(reserved)})


def test_the_engine_thread_is_pinned_to_the_cpus_left_and_its_threads_inherit_them() -> None:
    reserved = len(os.sched_getaffinity(0)) - 1  # the most there is to reserve: one CPU left
    seen = _claimed(reserved)
    rest = seen["allowed"][reserved:]
    assert seen["claimed"] == seen["engine"] == seen["child"] == rest
    assert seen["torch_threads"] == len(rest)
    assert seen["main"] == seen["allowed"]  # only the engine's thread was pinned


def test_reserving_nothing_keeps_every_cpu_and_a_thread_for_each() -> None:
    seen = _claimed(0)
    assert seen["claimed"] == seen["engine"] == seen["child"] == seen["allowed"]
    assert seen["torch_threads"] == len(seen["allowed"])


def test_serve_refuses_to_reserve_every_cpu_before_starting_anything() -> None:
    cpus = len(os.sched_getaffinity(0))
    result = subprocess.run([sys.executable, "-m", "meshserve.cli", "serve", "--reserved-cpus",
                             str(cpus)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        f"reserved_cpus: must be an integer from 0 to {cpus - 1} on this host ({cpus} CPUs), "
        f"got {cpus}"), result.stderr
    assert "loading" not in result.stdout  # no Ray, no model
