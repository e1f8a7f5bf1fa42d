"""What ``meshserve serve`` and the offline API print: their own lines and no one else's routine
notices; a cluster the server cannot join is one line that says why."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.server import free_port

# Routine lines of the libraries under the server, each seen on its console before it was quiet.
NOISE = ("Token authentication is enabled",  # Ray, on every new local cluster
         "No CUDA runtime is found",  # torch's cpp_extension, in every host actor
         "POST /v1/completions",  # Serve's per-request access log
         "CALL ready")  # Serve's controller, every 0.5 s while a replica loads


def test_default_console_carries_no_routine_notices(tiny_server) -> None:
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}
    assert httpx.post(f"{tiny_server.url}/v1/completions", json=body,
                      timeout=60).status_code == 200
    text = tiny_server.log.read_text()
    assert "meshserve: ready" in text and "warm-up done" in text
    assert [line for line in text.splitlines() if any(n in line for n in NOISE)] == [], text


@pytest.mark.slow
def test_a_script_using_the_offline_api_sees_only_meshserve_lines() -> None:
    """README's offline example, run as a plain script in a fresh interpreter on the bundled
    model: loading it once printed torch_xla's "Defaulting to PJRT_DEVICE=CPU" (transformers'
    GGUF loader imports accelerate, which imports torch_xla) and compiling it torch's "No CUDA
    runtime is found" (cpp_extension's import)."""
    script = ("from meshserve import LLM, SamplingParams\n"
              "llm = LLM(max_num_seqs=2, num_kv_blocks=64)\n"
              "params = SamplingParams(temperature=0.0, max_tokens=4)\n"
              "print(llm.generate(['The capital of France is'], params)[0].outputs[0].text)\n")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(" Paris")
    assert "warm-up done" in result.stderr
    others = [line for line in result.stderr.splitlines() if not line.startswith("meshserve: ")]
    assert others == [], result.stderr


@pytest.mark.slow
def test_a_cluster_that_wants_a_token_is_refused_in_one_line() -> None:
    # A head of its own with Ray's token authentication on; a short folder, since Ray's unix
    # socket paths under it must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    head_log = os.path.join(temp_dir, "head.log")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    with open(head_log, "w") as out:
        head = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", "--port", str(port),
             "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--include-dashboard", "false",
             "--disable-usage-stats", "--temp-dir", temp_dir],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in open(head_log).read():
            assert head.poll() is None and time.monotonic() < deadline, open(head_log).read()
            time.sleep(0.2)
        # The caller has no token setting: Ray sends no token to an address it is merely given.
        caller = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        result = subprocess.run(
            [sys.executable, "-m", "meshserve.cli", "serve", "--port", str(free_port()),
             "--address", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=180, env=caller)
    finally:
        head.send_signal(signal.SIGTERM)  # ``ray start --block`` stops its node's processes
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"meshserve serve: cannot join the Ray cluster at 127.0.0.1:{port}: it requires Ray's "
        "token authentication; set RAY_AUTH_MODE=token (with RAY_AUTH_TOKEN or "
        "RAY_AUTH_TOKEN_PATH where the token is not in ~/.ray/auth_token), or use --address auto "
        "for the cluster that runs on this machine")
    assert "loading" not in result.stdout  # nothing was deployed
