"""``meshserve serve --device xla --hosts-per-replica 2`` on a local Ray cluster shaped as a v4-16
slice: two nodes that Ray takes for the slice's hosts (``{"TPU": 4}`` each, the slice's labels,
``TPU-v4-16-head`` on worker 0), each running the xla backend on PJRT CPU.

Each simulated host runs the slice's whole SPMD program, as every host of a real slice does: 8
virtual devices standing for the slice's 2 hosts x 4 chips (``MESHSERVE_EMULATED_HOSTS``), a mesh
of the hosts (data) by each host's chips (model). The lead host schedules, the follower prepares
and runs every step after their fingerprints match, and the answers must equal the eager cpu
engine's. What a CPU cannot show is the collectives between two real hosts: here each process
computes the whole slice by itself.
"""

from __future__ import annotations

import httpx
import psutil
import pytest

from meshserve import LLM, SamplingParams
from tests.local_cluster import local_cluster, tpu_nodes
from tests.server import start_server

pytestmark = pytest.mark.slow

HOSTS, CHIPS = 2, 4
SLICE = dict(TPU_NAME="slice-a", TPU_ACCELERATOR_TYPE="v4-16", TPU_TOPOLOGY="2x2x2",
             PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(HOSTS * CHIPS),
             MESHSERVE_EMULATED_HOSTS=str(HOSTS), TF_CPP_MIN_LOG_LEVEL="2")
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "64"]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "A haiku about the sea:", "1 2 3 4"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def slice_server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    with local_cluster(head_cpus=2) as cluster, tpu_nodes(
            cluster, [{**SLICE, "TPU_WORKER_ID": str(w)} for w in range(HOSTS)], num_cpus=2):
        log = tmp_path_factory.mktemp("logs") / "serve-slice.log"
        server = start_server(
            ["--address", cluster.address, "--model", tiny_llama_dir, "--device", "xla",
             "--hosts-per-replica", str(HOSTS), "--tensor-parallel-size", str(CHIPS),
             "--data-parallel-size", str(HOSTS), *ENGINE], log)
        try:
            yield server
        finally:
            server.stop()


def cluster_processes() -> list[psutil.Process]:
    """This test's cluster (started from this process), not another test run's on the machine."""
    alive = []
    for process in psutil.Process().children(recursive=True):
        try:
            process.cmdline()
        except psutil.NoSuchProcess:
            continue
        alive.append(process)
    return alive


def test_two_simulated_hosts_on_xla_answer_as_the_eager_engine(slice_server,
                                                               tiny_llama_dir: str) -> None:
    eager = LLM(tiny_llama_dir, device="cpu", dtype="float32", max_model_len=256)
    expected = [o.outputs[0].text for o in eager.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    response = httpx.post(f"{slice_server.url}/v1/completions", timeout=300, json={
        "model": "tiny-llama", "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == expected
    # The second host is a FollowerHost actor with the slice's whole program; it ran every step
    # (a step it missed or ran differently would have failed the replica).
    (follower,) = [p for p in cluster_processes() if "FollowerHost" in " ".join(p.cmdline())]
    assert follower.environ()["CPU_NUM_DEVICES"] == str(HOSTS * CHIPS)
    assert follower.environ()["TPU_WORKER_ID"] == "1"
