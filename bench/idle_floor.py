"""What an idle ``meshserve serve`` costs an engine beside it, and which of its processes cost it.

    .venv/bin/python bench/idle_floor.py --stop-each

``bench/serving.py --idle-floor`` measures the floor: the engine offline runs slower while the
server is merely up (0.85x on 2 cores). This script explains it. It starts the server on
127.0.0.1, records every process of it at rest (CPU share and wake-ups a second, summed over its
threads), loads the same engine in this process, and then times ``LLM.generate`` (64 synthetic
prompts x 64 tokens, greedy, EOS ignored, fresh prompts each time so the prefix cache never skips
a prefill) in several states of the server:

- **idle server**: every process runs, with nothing to do;
- **server stopped**: every process of the server's session is stopped (SIGSTOP), so the engine
  has the machine to itself; every other state is reported as a share of this one;
- with ``--stop-each``, **without K** for each kind K of process (``process_cpu.process_kind``:
  the HostActor, each Serve replica, the controller, ``gcs_server``, ``raylet``, Ray's agents,
  the ``meshserve serve`` driver): only that kind is stopped, so the share it gains back is what
  it costs.

A stopped process is continued (SIGCONT) as soon as its leg ends, and in every case before the
script stops the server; legs last seconds, well inside Ray's and Serve's health-check timeouts.
The states are timed ``--rounds`` times (4), each round starting one state later, and reported
as medians of per-round shares: the VM drifts more within minutes than the gaps measured here.

Writes ``bench/results/idle_floor.json`` (the processes at rest, every round, the medians) and a
chart of the median shares beside it. CPU figures only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from common import REPO_ROOT, machine_info, write_json
from offline import native_dtypes
from process_cpu import TICKS_PER_S, process_kind
from serving import MESHSERVE, Server

IDLE, STOPPED = "idle server", "server stopped"
# Ray's per-node helpers, stopped together: each alone costs too little to tell from drift.
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "dashboard.py", "log_monitor.py",
          "monitor.py")
REST_S = 10.0  # how long the processes at rest are watched
SETTLE_S = 0.5  # after stopping processes, before the clock starts
# After continuing them: Ray's timers that fell due while they were stopped (heartbeats, health
# checks, metrics) all fire at once; that burst must not land in the next state's time.
CATCH_UP_S = 3.0


def server_processes(server: Server) -> dict[str, list[int]]:
    """kind -> pids of every process in the server's session (it starts its own), the Ray
    cluster it started included."""
    kinds: dict[str, list[int]] = {}
    for process in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if os.getsid(process.pid) != server.process.pid:
                continue
        except OSError:  # it ended meanwhile
            continue
        argv = [a for a in process.info["cmdline"] or [] if a]
        kind = process_kind(argv, process.info["name"] or "")
        kind = "Ray's agents" if kind in AGENTS else kind.removeprefix("ray::")
        kinds.setdefault(kind.removeprefix("ServeReplica:meshserve:"), []).append(process.pid)
    return kinds


def _switches_and_cpu(pid: int) -> tuple[int, float]:
    """Context switches summed over the process's threads (``/proc`` counts them per thread; a
    thread at rest switches out only to sleep, so each is one wake-up) and the process's
    CPU-seconds so far; (0, 0.0) for a process that is gone."""
    try:
        switches = sum(int(line.split(":")[1])
                       for thread in Path(f"/proc/{pid}/task").iterdir()
                       for line in (thread / "status").read_text().splitlines()
                       if "ctxt_switches:" in line)  # voluntary and not
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (OSError, ValueError):
        return 0, 0.0
    return switches, (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime + stime, ticks


def at_rest(kinds: dict[str, list[int]], seconds: float) -> dict[str, dict[str, float]]:
    """kind -> CPU share of one core (%) and wake-ups a second, over ``seconds`` of idleness."""
    pids = [pid for group in kinds.values() for pid in group]
    before = {pid: _switches_and_cpu(pid) for pid in pids}
    time.sleep(seconds)  # the measurement window itself, not a wait for a condition
    after = {pid: _switches_and_cpu(pid) for pid in pids}
    rest = {}
    for kind, group in kinds.items():
        switches = sum(after[pid][0] - before[pid][0] for pid in group)
        cpu = sum(after[pid][1] - before[pid][1] for pid in group)
        rest[kind] = {"cpu_percent": round(100 * cpu / seconds, 2),
                      "wakeups_per_s": round(switches / seconds)}
    return dict(sorted(rest.items(), key=lambda item: -item[1]["wakeups_per_s"]))


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """Stop ``pids`` for the block and continue them after it, whatever happens."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if pids:
            time.sleep(CATCH_UP_S)


def share_chart(path: Path, median: dict[str, float], title: str) -> None:
    """One horizontal bar per state: its throughput as % of the engine alone."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(median)[::-1]  # the first state on top
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.4 * len(names)))
    bars = ax.barh(names, [100 * median[n] for n in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%", padding=3, fontsize=8)
    ax.axvline(100, color="grey", linewidth=0.8)
    ax.set_xlim(min(80.0, 100 * min(median.values()) - 5), 105)
    ax.set_xlabel("offline throughput, % of the engine with the server stopped")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="the engine's max_num_seqs")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, or auto: the CPU's native")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--stop-each", action="store_true",
                   help="also time the engine with each kind of server process stopped alone")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--output", default=str(REPO_ROOT / "bench/results/idle_floor.json"))
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = native_dtypes()[0]
    return args


def main(argv: list[str] | None = None) -> None:
    from meshserve import LLM, SamplingParams
    from meshserve.benchmark.prompts import synthetic_prompts

    args = parse_args(argv)
    output = Path(args.output)
    logs = output.parent / "serving-logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = Server([MESHSERVE, "serve", "--host", "127.0.0.1", "--port", str(args.port),
                     "--dtype", args.dtype], f"http://127.0.0.1:{args.port}",
                    logs / "idle-floor.log", dict(os.environ))
    try:
        print("starting meshserve serve...", flush=True)
        server.wait_ready(args.ready_timeout)
        kinds = server_processes(server)
        print(f"the server's processes at rest ({REST_S:.0f} s)...", flush=True)
        rest = at_rest(kinds, REST_S)
        for kind, figures in rest.items():
            print(f"  {figures['wakeups_per_s']:6d} wake-ups/s  {figures['cpu_percent']:5.2f}% "
                  f"CPU  {kind}", flush=True)
        states = {IDLE: [], STOPPED: [pid for pids in kinds.values() for pid in pids]}
        if args.stop_each:
            states |= {f"without {kind}": pids for kind, pids in kinds.items()}

        llm = LLM(dtype=args.dtype, max_num_seqs=args.concurrency)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(["Warm-up. " + p for p in synthetic_prompts(4, seed=10**6)],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        rounds, seed, names = [], 0, list(states)
        for index in range(args.rounds):
            order = names[index % len(names):] + names[:index % len(names)]
            measured = {}
            for name in order:
                seed += 1
                prompts = synthetic_prompts(args.num_prompts, seed)
                with stopped(states[name]):
                    start = time.perf_counter()
                    outputs = llm.generate(prompts, params)
                    elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                measured[name] = round(tokens / elapsed, 1)
                print(f"round {index + 1}/{args.rounds}: {name}: {measured[name]} tok/s",
                      flush=True)
            rounds.append({"order": order, "output_throughput": measured,
                           "share_of_stopped": {name: round(v / measured[STOPPED], 3)
                                                for name, v in measured.items()}})
    finally:
        server.stop()

    median = {name: round(statistics.median(r["share_of_stopped"][name] for r in rounds), 3)
              for name in names}
    info = machine_info()
    write_json(output, {"config": vars(args), "machine": info, "at_rest": rest,
                        "rounds": rounds, "median_share_of_stopped": median})
    print("median share of the engine alone:", flush=True)
    for name, share in median.items():
        print(f"  {share:.3f}  {name}", flush=True)
    share_chart(output.with_suffix(".png"), median,
                f"The engine offline beside an idle meshserve serve, by what is stopped (median "
                f"of {args.rounds} rounds; {info['cpu_model']}, {info['cpu_count']} CPUs, "
                f"{args.dtype}; CPU figures)")
    print(f"wrote {output} and {output.with_suffix('.png')}", flush=True)


if __name__ == "__main__":
    main()
