"""The ``meshserve`` command: ``serve``, ``bench serve`` and ``k8s render`` / ``write-examples``.

Building the parser loads only plain-data modules (the config dataclasses, the benchmark's and the
renderer's flags); each handler imports what its command needs (Ray, httpx, YAML) when it runs.
``serve``'s setting flags are generated from the config dataclasses (``add_setting_flags``), so a
flag's type, default and help are the field's own.
"""

from __future__ import annotations

import os

# Keep every Ray socket on loopback; must be set before ray is imported anywhere.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from meshserve.benchmark.cli import add_bench_parser  # noqa: E402
from meshserve.config import flat_settings  # noqa: E402
from meshserve.deploy.settings import ServeSettings  # noqa: E402
from meshserve.kuberay.cli import add_k8s_parser  # noqa: E402


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--address", default=None,
                   help="an existing Ray cluster to join (default: start a local one on 127.0.0.1)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM (default: 30)")
    add_setting_flags(p, ServeSettings)
    # The spelling from before the flags were generated; still accepted.
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="same as --no-enable-prefix-caching")
    p.set_defaults(func=run_serve)


def add_setting_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per flat setting of the config dataclass ``cls`` (``--max-num-seqs`` for
    ``max_num_seqs``), typed, defaulted and described by the field itself."""
    for s in flat_settings(cls):
        flag = "--" + s.name.replace("_", "-")
        described = s.help if s.default is None else f"{s.help} (default: %(default)s)"
        if s.kind is bool:  # --name and --no-name
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=s.default,
                                help=described)
        else:
            parser.add_argument(flag, type=s.kind, default=s.default, choices=s.choices,
                                help=described)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings.from_args({s.name: getattr(args, s.name)
                                    for s in flat_settings(ServeSettings)})


def run_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from meshserve.deploy.app import build_app

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"meshserve serve: {exc}", file=sys.stderr)
        return 2
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
    serve.run(build_app(settings), name="meshserve", route_prefix="/", blocking=False)
    router = serve.get_deployment_handle("Router", app_name="meshserve")
    url = f"http://{args.host}:{args.port}"
    print(f"meshserve: loading {settings.model_name()} and warming up...", flush=True)
    started = time.monotonic()
    while True:
        try:
            if router.ready.remote().result():
                break
        except Exception as exc:  # noqa: BLE001 - report why the model did not come up
            print(f"meshserve: the model failed to start: {exc}", file=sys.stderr)
            serve.shutdown()
            return 1
        time.sleep(0.5)
    print(f"meshserve: ready in {time.monotonic() - started:.0f}s, serving "
          f"{settings.model_name()!r} at {url}/v1 (Ctrl+C to stop)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    drain(args.drain_timeout)
    serve.shutdown()
    ray.shutdown()
    return 0


def drain(timeout_s: float) -> None:
    """Stop taking requests, finish or cancel in-flight ones, and check every block is free."""
    from ray import serve

    print(f"meshserve: draining (up to {timeout_s:.0f}s)...", flush=True)
    ingress = serve.get_deployment_handle("OpenAIIngress", app_name="meshserve")
    router = serve.get_deployment_handle("Router", app_name="meshserve")
    report = ingress.drain.remote(timeout_s).result()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engines = router.stats.remote().result()["engines"]
        free = sum(e["num_free_blocks"] for e in engines)
        total = sum(e["num_total_blocks"] for e in engines)
        if free == total:
            break
        time.sleep(0.1)
    print(f"meshserve: drained: {report['finished']} finished, {report['cancelled']} cancelled; "
          f"{free}/{total} KV blocks free", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_k8s_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
