"""The readiness probe of meshserve's TPU worker pods: a request completes, not only a process
lives.

KubeRay's own readiness check for a RayService worker asks the node's raylet and the Serve proxy's
``/-/healthz`` whether they are up. Both keep answering while the request path behind them is
stalled (a replica's host hung in a collective, an engine thread wedged, a router that accepts and
never answers), so this probe also runs a one-token greedy completion through the pod's own Serve
proxy and the OpenAI route every client uses (``/v1/completions``, the serving side's route; the
probe adds none) and fails unless it comes back within a deadline.

Run by the kubelet as ``python -m meshserve.kuberay.probe --model NAME``: it needs only the
standard library, so each run costs a Python start-up and nothing of meshserve's stack. It exits 0
when healthy, else 1 with one line naming what failed (``kubectl describe pod`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from meshserve.deploy.settings import DEFAULT_API_KEY_ENV

# The dashboard agent's per-node health endpoint, as KubeRay's own probes query it.
RAYLET_HEALTH_PATH = "/api/local_raylet_healthz"
DEFAULT_AGENT_PORT = 52365
DEFAULT_SERVE_PORT = 8000
DEFAULT_DEADLINE_S = 10.0
PROBE_PROMPT = "ping"


class ProbeFailure(Exception):
    """What failed, in one line."""


def _fetch(request: urllib.request.Request, deadline: float, what: str) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ProbeFailure(f"{what}: no time left before the deadline")
    try:
        with urllib.request.urlopen(request, timeout=remaining) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")[:200]
        raise ProbeFailure(f"{what}: HTTP {error.code}: {body}") from None
    except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
        reason = getattr(error, "reason", error)
        raise ProbeFailure(f"{what}: {reason}") from None


def check_raylet(host: str, agent_port: int, deadline: float) -> None:
    body = _fetch(urllib.request.Request(f"http://{host}:{agent_port}{RAYLET_HEALTH_PATH}"),
                  deadline, "raylet health")
    if b"success" not in body:
        raise ProbeFailure(f"raylet health: unexpected answer {body[:200]!r}")


def check_generation(host: str, port: int, model: str, api_key: str | None,
                     deadline: float) -> None:
    """One greedy token through the proxy, the ingress, the replica choice and an engine step."""
    payload = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"http://{host}:{port}/v1/completions",
                                     data=json.dumps(payload).encode(), headers=headers,
                                     method="POST")
    body = _fetch(request, deadline, "one-token completion")
    try:
        choices = json.loads(body)["choices"]
    except (ValueError, KeyError, TypeError):
        raise ProbeFailure(f"one-token completion: not an OpenAI completion: {body[:200]!r}") \
            from None
    if not choices or choices[0].get("finish_reason") is None:
        raise ProbeFailure(f"one-token completion: no finished choice in {body[:200]!r}")


def probe(model: str, *, host: str = "127.0.0.1", port: int = DEFAULT_SERVE_PORT,
          agent_port: int | None = DEFAULT_AGENT_PORT, api_key: str | None = None,
          deadline_s: float = DEFAULT_DEADLINE_S) -> None:
    """Raise ``ProbeFailure`` unless the raylet is up (when ``agent_port`` is given) and a
    one-token completion finishes, all within ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    if agent_port is not None:
        check_raylet(host, agent_port, deadline)
    check_generation(host, port, model, api_key, deadline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.kuberay.probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_SERVE_PORT, help="Serve's HTTP port")
    parser.add_argument("--agent-port", type=int, default=DEFAULT_AGENT_PORT,
                        help="the Ray dashboard agent's port (0: skip the raylet check)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds the whole probe may take")
    parser.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV,
                        help="variable holding the API key, when the server requires one")
    args = parser.parse_args(argv)
    try:
        probe(args.model, host=args.host, port=args.port, agent_port=args.agent_port or None,
              api_key=os.environ.get(args.api_key_env) or None, deadline_s=args.deadline)
    except ProbeFailure as failure:
        print(f"unhealthy: {failure}")
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
