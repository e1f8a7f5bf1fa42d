"""Host failure: the lead HostActor of one of two engine replicas killed during traffic. Sequences
that had not started are retried on the other replica, streams already running end with an error
event (never a hang), Serve replaces the replica (its placement group and hosts), and serving
resumes on both."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.fault_streams import Outcome, Wave, assert_serves_again
from tests.server import HOSTS, processes, start_server

pytestmark = pytest.mark.slow

DEADLINE_S = 120


def test_killed_host_is_survived_and_replaced(tiny_llama_dir: str, tmp_path) -> None:
    server = start_server(["--model", tiny_llama_dir, "--num-kv-blocks", "200",
                           "--max-model-len", "512", "--num-replicas", "2"],
                          tmp_path / "serve.log")
    try:
        pids = processes(server.process.pid, HOSTS)
        assert len(pids) == 2
        results: dict[str, Outcome] = {}
        wave_one = Wave(server.url, "wave one", 8, 480, results, DEADLINE_S)
        wave_one.wait_started(DEADLINE_S)
        psutil.Process(pids[0]).send_signal(signal.SIGKILL)
        # Requests arriving right after the failure must not be lost.
        wave_two = Wave(server.url, "wave two", 8, 20, results, DEADLINE_S)
        wave_one.join(DEADLINE_S + 30)
        wave_two.join(DEADLINE_S + 30)

        ends = {prompt: outcome.end for prompt, outcome in results.items()}
        first = [ends[p] for p in wave_one.prompts]
        # The killed replica's running streams end with an error event; the others finish.
        assert set(first) <= {"error-event", "length"}, ends
        assert first.count("error-event") >= 1
        assert all(ends[p] == "length" for p in wave_two.prompts), ends
        assert all(o.seconds < DEADLINE_S for o in results.values())

        deadline = time.monotonic() + DEADLINE_S
        while server.metrics()["meshserve_healthy_replicas"] < 2:
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.5)
        new_pids = processes(server.process.pid, HOSTS)
        assert len(new_pids) == 2 and pids[0] not in new_pids
        assert_serves_again(server, DEADLINE_S)
    finally:
        server.stop()
