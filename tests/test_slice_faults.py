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
import threading
import time

import psutil
import pytest

from tests.local_cluster import local_cluster
from tests.server import start_server
from tests.test_faults import stream
from tests.test_slice_serve import cluster_processes

pytestmark = pytest.mark.slow

DEADLINE_S = 5.0  # --step-deadline-s
SETTLE_S = 20.0  # after the deadline: the failure reaches the ingress and the streams end
RECOVERY_S = 180.0  # Serve notices, replaces the replica and the new one loads


ENDED: dict[str, float] = {}  # prompt -> when its stream ended


def timed_stream(url: str, prompt: str, max_tokens: int, results: dict,
                 started: threading.Event) -> None:
    stream(url, prompt, max_tokens, results, started)
    ENDED[prompt] = time.monotonic()


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
            results: dict = {}
            running = [threading.Event() for _ in range(8)]
            first = [threading.Thread(target=timed_stream, args=(server.url, f"wave one {i}", 200,
                                                           results, running[i]))
                     for i in range(8)]
            for t in first:
                t.start()
            for event in running:
                assert event.wait(120), "generation did not start"
            frozen = hosts[0]
            frozen.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                # Sequences that arrive after the freeze must not wait on the frozen replica.
                second = [threading.Thread(target=timed_stream, args=(server.url, f"wave two {i}", 16,
                                                                results, threading.Event()))
                          for i in range(6)]
                for t in second:
                    t.start()
                for t in first + second:
                    t.join(120)
                assert not any(t.is_alive() for t in first + second), "a request never ended"
            finally:
                if frozen.is_running():
                    frozen.send_signal(signal.SIGCONT)

            outcomes = {p: r[0] for p, r in results.items()}
            wave_one = [f"wave one {i}" for i in range(8)]
            assert {outcomes[p] for p in wave_one} <= {"error-event", "length"}, outcomes
            # The frozen replica's running streams ended with an error, within the deadline.
            failed = [p for p in wave_one if outcomes[p] == "error-event"]
            assert failed, outcomes
            late = {p: ENDED[p] - frozen_at for p in failed}
            assert all(t < DEADLINE_S + SETTLE_S for t in late.values()), late
            wave_two = {p: results[p] for p in outcomes if p.startswith("wave two")}
            assert all(r[0] == "length" for r in wave_two.values()), wave_two

            deadline = time.monotonic() + RECOVERY_S
            while server.metrics()["meshserve_healthy_replicas"] < 2 or len(followers()) < 2 \
                    or frozen in followers():
                assert time.monotonic() < deadline, "the failed replica was not replaced"
                time.sleep(0.5)
            after: dict = {}
            third = [threading.Thread(target=timed_stream, args=(server.url, f"after {i}", 10, after,
                                                           threading.Event())) for i in range(6)]
            for t in third:
                t.start()
            for t in third:
                t.join(120)
            assert len(after) == 6 and all(r[0] == "length" for r in after.values()), after
            metrics = server.wait_idle()
            assert metrics["meshserve_kv_cache_free_blocks"] == \
                metrics["meshserve_kv_cache_total_blocks"]
        finally:
            server.stop()
