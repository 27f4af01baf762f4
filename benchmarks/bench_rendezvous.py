"""Time the full rendezvous of N clients: aiodist's server against torch's TCPStore.

One run, for either system, is what every rank of a job does at start-up:

1. join the job (aiodist: ``open_process_group``, which returns once all N
   joined; TCPStore: connect a client store and ``add("rank", 1)``);
2. set its own key ``addr/{rank}``;
3. wait for all N ``addr/*`` keys;
4. pass a barrier (aiodist: the server-side ``session.barrier()``; TCPStore:
   torch's store-based barrier, ``add("barrier", 1)`` then ``wait(["barrier_done"])``,
   where the client that brings the count to N sets ``barrier_done``).

Both servers run in their own process for the whole benchmark: ``aiodist serve``
as a subprocess, the TCPStore master (libuv) in a spawned process. Clients are
spread over a few worker processes: aiodist clients as tasks on one uvloop loop
per worker, TCPStore clients (a blocking API) as threads. Each run uses a fresh
job name / key prefix. The clock starts when the parent releases the workers
(all prepared, waiting at a barrier) and stops when the last client has passed
the barrier; each worker stamps its clients on the machine-wide monotonic clock.
A failed or timed-out run restarts the worker pool and that system's server, so
a server still busy with a broken job cannot slow the next measurement.

What the two joins do differs: aiodist's join also starts each client's
data-plane listeners and hands every client the whole member table (one row per
rank) when the job forms; TCPStore's is a connection and one ``add``.

TCPStore processes get ``RES_OPTIONS=use-vc`` unless ``--no-dns-workaround``
is given: see ``DNS_WORKAROUND``.

Usage::

    python -m benchmarks.bench_rendezvous [--sizes 16 128 1024] [--repeats K] [--quick]

Results go to ``benchmarks/results/rendezvous.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Final

from benchmarks._common import (
    Goal,
    format_table,
    goal_table,
    raise_fd_limit,
    rank_context,
    summarize,
    write_results,
)
from benchmarks._rendezvous_workers import (
    PHASES,
    SYSTEMS,
    RunResult,
    System,
    worker_pool,
)
from benchmarks._servers import (
    DNS_WORKAROUND,
    HOST,
    AiodistServer,
    Server,
    TCPStoreMaster,
    running,
)
from benchmarks.rdzv_sim import SIM_SIZES, render_sim, sim_bench, sim_goals

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["DNS_WORKAROUND", "AiodistServer", "bench", "goal_list", "render"]

DEFAULT_SIZES: Final = (16, 128, 1024)
QUICK_SIZES: Final = (16, 128)
QUICK_REPEATS: Final = 2
DEFAULT_WORKERS: Final = 4
# Seconds one run may take before it counts as a timeout (also the clients' op timeout).
DEFAULT_RUN_TIMEOUT: Final = 30.0


def default_repeats(world_size: int) -> int:
    """More repeats where runs are cheap."""
    return 7 if world_size <= 16 else 5 if world_size <= 128 else 3


# --- the benchmark ------------------------------------------------------------------------------


def _restart(server: Server) -> None:
    server.stop()
    server.start()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def bench(
    sizes: Sequence[int],
    repeats: int | None,
    *,
    systems: Sequence[System] = SYSTEMS,
    workers: int,
    timeout: float,
    profile_server: str | None = None,
) -> dict[str, Any]:
    """Run every size for both systems; return the results as plain data."""
    ctx = rank_context()
    results: list[dict[str, Any]] = []
    systems = [s for s in SYSTEMS if s in systems]
    with contextlib.ExitStack() as stack:
        # The workers import torch while the servers start.
        pool = stack.enter_context(worker_pool(ctx, workers))
        servers: dict[System, Server] = {}
        if "aiodist" in systems:
            servers["aiodist"] = stack.enter_context(running(AiodistServer(profile_server)))
        if "tcpstore" in systems:
            servers["tcpstore"] = stack.enter_context(running(TCPStoreMaster(ctx)))
        for system in systems:  # warm-up: first connections, lazy imports, thread pools
            if pool.run(system, servers[system].port, min(sizes), timeout).wall is None:
                _restart(servers[system])
        for n in sizes:
            runs: dict[System, list[RunResult]] = {s: [] for s in systems}
            k = repeats or default_repeats(n)
            for i in range(k):
                # Alternate which system goes first, so neither always runs on a warmer machine.
                for system in systems if i % 2 == 0 else systems[::-1]:
                    if any(r.wall is None for r in runs[system]):
                        continue  # it failed or timed out at this size: skip its remaining repeats
                    result = pool.run(system, servers[system].port, n, timeout)
                    runs[system].append(result)
                    if result.wall is None:
                        # A failed server may still be busy; it must not slow the other system.
                        _restart(servers[system])
                    shown = (
                        f"{_ms(result.wall)} ms"
                        if result.wall is not None
                        else f"FAILED: {result.error[:160]}"
                    )
                    print(f"  N={n:<5} {system:<8} run {i + 1}/{k}: {shown}", flush=True)
            results.append(_size_result(n, runs))
    return {
        "config": {
            "sizes": list(sizes),
            "repeats": repeats,
            "systems": systems,
            "workers": workers,
            "timeout_s": timeout,
            "host": HOST,
            "environment_overrides": {k: os.environ.get(k) for k in DNS_WORKAROUND},
            "aiodist_loop": "uvloop",
            "tcpstore": {"use_libuv": True, "clients": "threads"},
        },
        "phases": list(PHASES),
        "results": results,
    }


def _size_result(n: int, runs: dict[System, list[RunResult]]) -> dict[str, Any]:
    out: dict[str, Any] = {"world_size": n}
    for system, rs in runs.items():
        walls = [r.wall for r in rs if r.wall is not None]
        summary = summarize(walls)
        out[system] = {
            "wall_s": walls,
            "summary_s": summary,
            "phases_s": {
                name: summarize([r.phases[i] for r in rs if r.wall is not None])
                for i, name in enumerate(PHASES)
            },
            "errors": [r.error for r in rs if r.error],
        }
    aio = out.get("aiodist", {}).get("summary_s")
    tcp = out.get("tcpstore", {}).get("summary_s")
    out["ratio_tcpstore_over_aiodist"] = (
        tcp.median / aio.median if aio is not None and tcp is not None else None
    )
    return out


def render(data: dict[str, Any]) -> str:
    """The summary table and the per-phase table."""
    rows = []
    phase_rows = []
    for res in data["results"]:
        n = res["world_size"]
        cells: list[str] = [str(n)]
        for system in SYSTEMS:
            if system not in res:
                cells += ["not run", "-"]
                continue
            s = res[system]["summary_s"]
            if s is None:
                errors = res[system]["errors"]
                kind = errors[0].split(":")[0].rsplit(".", 1)[-1] if errors else "failed"
                cells += [kind, "-"]
            else:
                cells += [_ms(s.median), s.spread(1e3)]
            phases = res[system]["phases_s"]
            phase_rows.append(
                [str(n), system]
                + [_ms(phases[p].median if phases[p] else None) for p in data["phases"]]
            )
        ratio = res["ratio_tcpstore_over_aiodist"]
        cells.append("-" if ratio is None else f"{ratio:.1f}x")
        rows.append(cells)
    main = format_table(
        [
            "N",
            "aiodist median (ms)",
            "aiodist min-max",
            "TCPStore median (ms)",
            "TCPStore min-max",
            "TCPStore/aiodist",
        ],
        rows,
    )
    phases = format_table(["N", "system", *(f"{p} (ms)" for p in data["phases"])], phase_rows)
    return (
        f"{main}\n\nWhen the last client finished each step (median, ms after the start):\n{phases}"
    )


GOAL_SIZE: Final = 1024
GOAL_SPEEDUP: Final = 8.0  # issue 2: aiodist at least 8x faster than TCPStore at N = 1024


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """aiodist's rendezvous at least 8x faster than TCPStore's at N = 1024 (issue 2)."""
    row = next((r for r in data["results"] if r["world_size"] == GOAL_SIZE), None)
    value = None if row is None else row["ratio_tcpstore_over_aiodist"]
    return [
        Goal.judge(
            f"rendezvous N={GOAL_SIZE}",
            "speed-up TCPStore/aiodist",
            ">=",
            GOAL_SPEEDUP,
            value,
            "issue 2",
        )
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.bench_rendezvous``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_rendezvous", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=None, metavar="N")
    parser.add_argument("--repeats", type=int, default=None, metavar="K")
    parser.add_argument("--quick", action="store_true", help="N=16,128 with 2 repeats")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--timeout", type=float, default=DEFAULT_RUN_TIMEOUT, metavar="SECONDS")
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="what to run"
    )
    parser.add_argument(
        "--no-dns-workaround",
        action="store_true",
        help=f"do not set {' '.join(f'{k}={v}' for k, v in DNS_WORKAROUND.items())}",
    )
    parser.add_argument(
        "--profile-server", metavar="PATH", help="run `aiodist serve` under cProfile, write PATH"
    )
    parser.add_argument(
        "--sim",
        action="store_true",
        help="the join-storm simulator (rdzv_sim.py): N lightweight ranks with pre-encoded "
        "frames, N = 1K, 4K, 16K, 64K by default",
    )
    parser.add_argument(
        "--ranks-per-connection",
        type=int,
        default=1,
        metavar="K",
        help="--sim: K simulated aiodist ranks share each connection, each on its own channel "
        "(as the members of one process do); sizes beyond the open-files limit use 8",
    )
    args = parser.parse_args(argv)
    if not args.no_dns_workaround:
        for key, value in DNS_WORKAROUND.items():
            os.environ.setdefault(key, value)  # spawned processes inherit it
    if args.sim:
        return _main_sim(args)
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else None)
    if min(sizes) < 1 or args.workers < 1 or (repeats is not None and repeats < 1):
        parser.error("sizes, --repeats and --workers must be >= 1")
    # Each server holds one socket per client; children inherit the limit.
    fds = raise_fd_limit(2 * max(sizes) + 1024)
    if fds < max(sizes) + 64:
        print(f"warning: only {fds} file descriptors allowed; large N may fail", file=sys.stderr)
    print(
        f"rendezvous of N clients over {args.workers} worker processes, sizes {list(sizes)}"
        + ("" if args.no_dns_workaround else f" ({DNS_WORKAROUND}, see DNS_WORKAROUND)"),
        flush=True,
    )
    data = bench(
        sizes,
        repeats,
        systems=args.systems,
        workers=args.workers,
        timeout=args.timeout,
        profile_server=args.profile_server,
    )
    path = write_results("rendezvous", data)
    print()
    print(render(data))
    print(goal_table(goal_list(data)))
    print(f"\nresults: {path}")
    return 0


def _main_sim(args: argparse.Namespace) -> int:
    sizes = args.sizes or (SIM_SIZES[:2] if args.quick else SIM_SIZES)
    fds = raise_fd_limit(2 * max(sizes) + 1024)
    print(f"join storm of N simulated ranks, sizes {list(sizes)}; open files {fds}", flush=True)
    if fds < max(sizes) + 64:
        print(f"warning: only {fds} file descriptors allowed; large N may fail", file=sys.stderr)
    data = sim_bench(
        sizes,
        args.repeats or 1,
        systems=args.systems,
        timeout=max(args.timeout, 120.0),
        profile_server=args.profile_server,
        open_files=fds,
        ranks_per_connection=args.ranks_per_connection,
    )
    path = write_results("rendezvous_sim", data)
    print()
    print(render_sim(data))
    print(goal_table(sim_goals(data)))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
