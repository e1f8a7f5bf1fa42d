"""A host that stops answering: one follower of a two-host replica frozen with SIGSTOP under load.

Two engine replicas of two hosts each on a local Ray cluster (a head and four one-CPU nodes, every
socket on 127.0.0.1), served by ``meshserve serve`` with a 5 s step deadline. Freezing a follower
neither kills a process nor closes a connection, so only the deadline can notice: the lead's wait
for the frozen host's step runs out, the replica fails, its running streams end with an error
event within the deadline, sequences that had not started are served by the other replica, Serve
replaces the failed replica (its placement group, the frozen process with it), and serving comes
back with every KV block free.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.fault_streams import Outcome, Wave, assert_serves_again
from tests.local_cluster import local_cluster
from tests.server import start_server
from tests.test_slice_serve import cluster_processes

pytestmark = pytest.mark.slow

DEADLINE_S = 5.0  # --step-deadline-s
SETTLE_S = 20.0  # after the deadline: the failure reaches the ingress and the streams end
RECOVERY_S = 180.0  # Serve notices, replaces the replica and the new one loads
STREAM_S = 120.0  # the longest any stream may take


def followers() -> list[psutil.Process]:
    return [p for p in cluster_processes() if "FollowerHost" in " ".join(p.cmdline())]


def test_a_frozen_host_fails_its_replica_within_the_deadline_and_serving_comes_back(
        tiny_llama_dir: str, tmp_path) -> None:
    with local_cluster(workers=4, head_cpus=2) as cluster:
        server = start_server(
            ["--address", cluster.address, "--model", tiny_llama_dir, "--device", "cpu",
             "--hosts-per-replica", "2", "--num-replicas", "2",
             "--step-deadline-s", str(DEADLINE_S), "--max-model-len", "512"],
            tmp_path / "serve.log")
        try:
            hosts = followers()
            assert len(hosts) == 2
            results: dict[str, Outcome] = {}
            wave_one = Wave(server.url, "wave one", 8, 200, results, STREAM_S)
            wave_one.wait_started(STREAM_S)
            frozen = hosts[0]
            frozen.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                # Sequences that arrive after the freeze must not wait on the frozen replica.
                wave_two = Wave(server.url, "wave two", 6, 16, results, STREAM_S)
                wave_one.join(STREAM_S)
                wave_two.join(STREAM_S)
            finally:
                if frozen.is_running():
                    frozen.send_signal(signal.SIGCONT)

            ends = {prompt: outcome.end for prompt, outcome in results.items()}
            assert {ends[p] for p in wave_one.prompts} <= {"error-event", "length"}, ends
            # The frozen replica's running streams ended with an error, within the deadline.
            failed = [p for p in wave_one.prompts if ends[p] == "error-event"]
            assert failed, ends
            late = {p: results[p].ended_at - frozen_at for p in failed}
            assert all(t < DEADLINE_S + SETTLE_S for t in late.values()), late
            assert all(ends[p] == "length" for p in wave_two.prompts), ends

            deadline = time.monotonic() + RECOVERY_S
            while server.metrics()["meshserve_healthy_replicas"] < 2 or len(followers()) < 2 \
                    or frozen in followers():
                assert time.monotonic() < deadline, "the failed replica was not replaced"
                time.sleep(0.5)
            assert_serves_again(server, STREAM_S)
        finally:
            server.stop()
