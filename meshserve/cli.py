"""The ``meshserve`` command: ``serve``, ``bench serve`` and ``k8s render`` / ``write-examples``.

Building the parser loads only plain-data modules (the config dataclasses, the benchmark's and the
renderer's flags); each handler imports what its command needs (Ray, aiohttp, YAML) when it runs.
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

APP_NAME = "meshserve"
LOG_LEVELS = ("debug", "info", "warning", "error")
EDGES = ("ingress", "proxy")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--edge", choices=EDGES, default="ingress",
                   help="what answers HTTP: ingress (every ingress replica listens on "
                        "--host:--port itself, sharing it with SO_REUSEPORT: no proxy process in "
                        "every token's path) or proxy (Ray Serve's HTTP proxy forwards every "
                        "request and streamed chunk to an ingress replica, as on KubeRay) "
                        "(default: ingress)")
    p.add_argument("--address", default=None,
                   help="an existing Ray cluster to join, or auto for the one `ray start` runs "
                        "on this machine (default: start a local one on 127.0.0.1)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM (default: 30)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                   help="what Ray, Serve and meshserve log beyond meshserve's own progress lines "
                        "(loading, warm-up, ready, URL); info and debug bring back Serve's "
                        "component logs and its per-request access log (default: warning)")
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
        text = s.help.replace("%", "%%")  # argparse formats help with %: a literal % is %%
        described = text if s.default is None else f"{text} (default: %(default)s)"
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
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"meshserve serve: {exc}", file=sys.stderr)
        return 2
    if not args.address:
        # Set before anything imports Ray, which reads RAY_AUTH_MODE then; the processes it
        # starts inherit them all.
        for name, value in {**CALM_RAY_ENV, **LOCAL_AUTH_ENV}.items():
            os.environ.setdefault(name, value)
        # The server and its hosts run on this machine: clear errors now, not a replica that
        # fails to bind or to claim its CPUs once the model has loaded.
        from meshserve.actors.cpus import split_cpus
        from meshserve.deploy.listener import listening_socket

        try:
            listening_socket(args.host, args.port, shared=False).close()
        except OSError as exc:
            print(f"meshserve serve: {exc.strerror}", file=sys.stderr)
            return 2
        try:
            split_cpus(settings.reserved_cpus)
        except ValueError as exc:
            print(f"meshserve serve: {exc}", file=sys.stderr)
            return 2
    logging_config = quiet_logs(args.log_level)
    import ray
    from ray import serve

    from meshserve.deploy.app import application

    if args.address:
        try:
            ray.init(address=args.address, logging_level=args.log_level.upper())
        except ConnectionError as exc:
            print(f"meshserve serve: {join_failure(args.address, exc)}", file=sys.stderr)
            return 2
    else:
        # address="local": a cluster of its own, even when another runs on this machine.
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 logging_level=args.log_level.upper())
    direct = args.edge == "ingress"
    # Serve's HTTP options are its proxy's. With the ingress listening itself there is no proxy,
    # and on a cluster where Serve runs already, options other than its own would only draw its
    # warning that they are ignored, as if --port were.
    http_options = None if direct else {"host": args.host, "port": args.port}
    serve.start(http_options=http_options, proxy_location="Disabled" if direct else "HeadOnly",
                logging_config=logging_config)
    mismatch = None if direct else proxy_mismatch(args.host, args.port)
    if mismatch:  # a joined cluster's Serve keeps its own proxy: --host:--port would be a lie
        # Nothing of meshserve's is deployed yet, and that Serve is someone else's: leave it be.
        print(f"meshserve serve: --edge proxy: {mismatch}", file=sys.stderr)
        return 2
    url = f"http://{args.host}:{args.port}"
    print(f"meshserve: loading {settings.model_name()} and warming up...", flush=True)
    started = time.monotonic()
    try:
        # Returns once every replica has loaded and warmed up (Serve waits for their
        # constructors, without calling into the application).
        serve.run(application(settings, (args.host, args.port) if direct else None), name=APP_NAME,
                  route_prefix="/", logging_config=logging_config)
    except KeyboardInterrupt:
        print("meshserve: interrupted while loading; stopping", file=sys.stderr, flush=True)
        leave_serve(joined=bool(args.address))
        ray.shutdown()
        return 130
    except Exception as exc:  # noqa: BLE001 - report why the model did not come up
        print(f"meshserve: the model failed to start: {exc}", file=sys.stderr)
        leave_serve(joined=bool(args.address))
        return 1
    print(f"meshserve: ready in {time.monotonic() - started:.0f}s, serving "
          f"{settings.model_name()!r} at {url}/v1 (Ctrl+C to stop)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    drain(args.drain_timeout)
    if args.address:  # a cluster of someone else's: leave it up
        leave_serve(joined=True)
    # Otherwise the cluster is this process's own, and every Serve process ends with it. Serve's
    # shutdown would add nothing once drained but two warnings on the console: its controller
    # kills itself while calls to it, which Ray retries, are still out.
    ray.shutdown()
    return 0


# On a local Ray, Ray's and Serve's processes share the engine's cores, and the CPU time they take
# while a step computes costs the engine about 1.6 times as much: the preempted OpenMP thread's
# partner waits for it at the next barrier (bench/README.md, idle_floor.py). So the loops that do
# not need to be quick run at a calmer pace: Serve's controller loop (default 0.1 s; a replica to
# replace is noticed up to a second later) and every replica's metrics export (0.1 s); Ray's log
# monitor, which looks for new worker log files on every 0.1 s poll (now every 5 s: a new
# worker's first lines reach the console up to 5 s late) and its autoscaler monitor (5 s; this
# cluster never scales). Together they took the idle server from 10.8% to 9.0% of a core, and
# the engine beside it from 86.6% to 90.9% of its speed alone (9 interleaved rounds, 2 cores).
# Ray's own metrics (its processes' Prometheus series, which nothing reads on this cluster:
# it has no dashboard, and meshserve's /metrics comes from the ingress and the engines) are not
# collected: that takes the idle server from 9.3-9.5% to 8.6-8.9% of a core (Ray's dashboard
# agent, which gathers them, from 0.85% to 0.45%) and the agent from 0.14 to 0.06 CPU-s of a
# served 64 x 64 burst (bench/README.md).
# Values already in the environment win.
CALM_RAY_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
                "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",  # rescan names on the interval only
                "LOG_NAME_UPDATE_INTERVAL_S": "5",
                "AUTOSCALER_UPDATE_INTERVAL_S": "30",
                "RAY_enable_metrics_collection": "0"}


# Ray turns token authentication on for a new local cluster, and says so on the console; asked for
# by name it is the same cluster without the notice. RAY_AUTH_MODE=disabled in the environment
# still turns it off.
LOCAL_AUTH_ENV = {"RAY_AUTH_MODE": "token"}


def join_failure(address: str, exc: ConnectionError) -> str:
    """Why ``--address`` could not be joined, in one line; for a cluster that wants a token,
    what to set. Ray sends its token only where ``RAY_AUTH_MODE=token`` says to (or to the cluster
    it finds on this machine with ``auto``), never to an address it is merely given."""
    reason = f"{exc}: {exc.__cause__}" if exc.__cause__ is not None else str(exc)
    if "InvalidAuthToken" in reason:
        return (f"cannot join the Ray cluster at {address}: it requires Ray's token "
                "authentication; set RAY_AUTH_MODE=token (with RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH where the token is not in ~/.ray/auth_token), or use "
                "--address auto for the cluster that runs on this machine")
    return f"cannot join the Ray cluster at {address}: {reason.splitlines()[0]}"


def proxy_mismatch(host: str, port: int) -> str | None:
    """Why Serve's proxy does not answer on ``host:port``, or None when it does. A Serve that
    already ran on a joined cluster keeps its own proxy settings (serve.start only warns), so
    the URL meshserve would print could lead nowhere. Serve's public API does not give those
    settings (``serve.status`` names proxies, not their address); its client's instance
    details, what Serve's REST API serves, do (Ray is pinned in pyproject.toml)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    options = details.get("http_options") or {}
    use_ingress = "leave --edge at ingress, which listens on --host:--port itself"
    location = details.get("proxy_location")
    if getattr(location, "value", location) == "Disabled" or not options:
        return f"Serve on this cluster runs no HTTP proxy; {use_ingress}"
    if (options.get("host"), options.get("port")) != (host, port):
        return (f"Serve's proxy on this cluster listens on {options.get('host')}:"
                f"{options.get('port')}, not {host}:{port}; pass --host {options.get('host')} "
                f"--port {options.get('port')}, or {use_ingress}")
    return None


def quiet_logs(level: str):
    """Apply ``--log-level`` here and in every process the server starts; returns Serve's
    logging config for its components and replicas."""
    import logging

    from ray.serve.schema import LoggingConfig

    from meshserve.logs import LOG_LEVEL_ENV, configure_process_logging

    # Replicas read it when they start (they inherit this environment on a local cluster).
    os.environ[LOG_LEVEL_ENV] = level
    if level not in ("debug", "info"):  # warm-up is already reported, line by line
        os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", "120")
    configure_process_logging()
    logging.getLogger("ray.serve").setLevel(level.upper())
    verbose = level in ("debug", "info")
    return LoggingConfig(log_level=level.upper(), enable_access_log=verbose)


def leave_serve(joined: bool) -> None:
    """Take meshserve's application off Serve, and Serve off the cluster, except from a cluster
    this process joined where Serve runs other applications: they are someone else's."""
    from ray import serve

    if joined:
        serve.delete(APP_NAME)
        if serve.status().applications:
            return
    serve.shutdown()


def drain(timeout_s: float) -> None:
    """Stop taking requests, finish or cancel in-flight ones, and check every block is free."""
    import asyncio

    from ray import serve

    from meshserve.deploy.app import ENGINE_DEPLOYMENT
    from meshserve.deploy.client import EngineClient

    print(f"meshserve: draining (up to {timeout_s:.0f}s)...", flush=True)
    engines = EngineClient(serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME))

    async def run() -> tuple[dict, int, int]:
        await engines.handle.info.remote()  # this process's router now knows the replicas
        reports = await engines.each_replica("drain", timeout_s)
        report = {k: sum(r[k] for r in reports) for k in ("finished", "cancelled")}
        deadline = time.monotonic() + 30
        while True:
            stats = [r["engine"] for r in await engines.each_replica("stats")]
            free = sum(e["num_free_blocks"] for e in stats)
            total = sum(e["num_total_blocks"] for e in stats)
            if free == total or time.monotonic() > deadline:
                return report, free, total
            await asyncio.sleep(0.1)

    report, free, total = asyncio.run(run())
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
