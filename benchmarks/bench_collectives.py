"""Time aiodist's collectives against torch.distributed (gloo), side by side in one run.

For each world size, two sets of N spawned processes start together: N gloo
ranks (``init_process_group("gloo")`` over a TCPStore on 127.0.0.1) and N
aiodist ranks (``open_process_group`` against an ``aiodist serve`` daemon,
uvloop, the async API as a user would call it). Both stay up for the whole
world size; the parent sends every batch of a case to one system, then the
other (alternating which goes first), so a busy machine slows both alike.

A case runs a warm-up that also checks the result, then ``repeats`` timed
batches of ``iters`` back-to-back calls per system, each batch after the
system's own barrier. A batch's time per call is the slowest rank's; the table shows the
median over batches and its min-max spread. Bandwidths follow nccl-tests:
``algbw = size / time`` and bus bandwidth ``busbw = algbw * factor`` with
factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and
reduce_scatter (``size`` being the whole gathered or scattered buffer) and 1
for broadcast and point-to-point. Ratios are aiodist/gloo: below 1 means
aiodist is faster for times, above 1 means it moves more bytes per second for
bandwidths.

Memory: in fresh processes warmed up with a small all_reduce, each rank
resets its peak RSS (``/proc/self/clear_refs``), runs one 64 MiB all_reduce
and reports how far its RSS peaked above where it started, in tensor sizes,
and how much its proportional set size (PSS) grew, which counts shared memory
once across the ranks that map it (RSS counts it in full in each).

``--small`` runs only the small-message set of issue 24 (an 8 B round trip,
a barrier, a 4 B all_reduce) at world sizes 2 to 16 and judges its goals
(``benchmarks/_small.py``): per-call overhead and how it grows with the ranks.

Usage::

    python -m benchmarks.bench_collectives [--quick | --smoke] [--small] [--world-sizes 2 4]
        [--repeats K]

Results go to ``benchmarks/results/collectives.json`` (``small.json`` with ``--small``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import uuid
from typing import TYPE_CHECKING, Any, Final, Literal

from benchmarks._collective_ranks import (
    CASE_TIMEOUT,
    HOST,
    STARTUP_TIMEOUT,
    SYSTEMS,
    Case,
    MiB,
    Mode,
    RankReport,
    Run,
    System,
    aiodist_main,
    bus_factor,
    cases,
    describe,
    gloo_main,
    moved_bytes,
    timed_ranks,
)
from benchmarks._common import (
    Goal,
    format_table,
    goal_table,
    now,
    rank_context,
    summarize,
    write_results,
)
from benchmarks._servers import DNS_WORKAROUND, AiodistServer
from benchmarks._small import SMALL_CASES, SMALL_WORLD_SIZES
from benchmarks._small import render as render_small

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, ForkServerProcess


DEFAULT_REPEATS: Final[dict[Mode, int]] = {"full": 5, "quick": 3, "smoke": 1}
DEFAULT_BATCH_MS: Final[dict[Mode, float]] = {"full": 25.0, "quick": 10.0, "smoke": 5.0}


# --- the parent ---------------------------------------------------------------------------------


class Ranks:
    """N spawned ranks of one system, driven over pipes."""

    def __init__(self, ctx: ForkServerContext, system: System, n: int, address: str) -> None:
        self.system, self.n = system, n
        self.error = ""
        self._procs: list[ForkServerProcess] = []
        self._conns: list[Connection] = []
        job = f"bench-collectives-{n}-{uuid.uuid4().hex[:8]}"
        for rank in range(n):
            parent_end, child_end = ctx.Pipe()
            if system == "gloo":
                target, args = gloo_main, (child_end, rank, n, int(address))
            else:
                target, args = aiodist_main, (child_end, rank, n, address, job)  # type: ignore[assignment]
            proc = ctx.Process(target=target, args=args, name=f"{system}-{rank}", daemon=True)
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def wait_up(self) -> None:
        try:
            for conn in self._conns:
                if self._recv(conn, STARTUP_TIMEOUT) != "up":
                    raise RuntimeError("a rank sent an unexpected start-up message")
        except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
            self.fail(f"start-up: {describe(exc)}")

    def _recv(self, conn: Connection, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise TimeoutError(f"{self.system} rank did not answer within {timeout:.0f} s")
        return conn.recv()

    def run(self, run: Run) -> list[RankReport] | None:
        """Every rank's report, or None (and ``error`` set) if the system failed."""
        if self.error:
            return None
        try:
            for conn in self._conns:
                conn.send(run)
            deadline = now() + CASE_TIMEOUT
            reports: list[RankReport] = [
                self._recv(conn, max(0.0, deadline - now())) for conn in self._conns
            ]
        except (OSError, EOFError, TimeoutError) as exc:
            self.fail(describe(exc))
            return None
        return reports

    def fail(self, error: str) -> None:
        self.error = error
        self.close()

    def stop(self) -> None:
        """Ask every rank to leave; ``close()`` then waits for them."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)

    def close(self) -> None:
        self.stop()
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _errors(ranks: Ranks, reports: list[RankReport] | None) -> str:
    if reports is None:
        return ranks.error
    return next((f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error), "")


def _warm_up(ranks: Ranks, case: Case, target: float) -> dict[str, Any]:
    """Run ``case`` once (checking its result); pick the batch size, or report memory."""
    warm = ranks.run(Run(case, None, 1))
    error = _errors(ranks, warm)
    if error:
        return {"error": error}
    assert warm is not None
    if case.op == "memory":
        extra = max(rep.extra_bytes for rep in warm)
        pss = max(rep.pss_extra_bytes for rep in warm)
        return {
            "extra_bytes": extra,
            "extra_tensor_sizes": extra / case.nbytes,
            "pss_extra_bytes": pss,
            "pss_extra_tensor_sizes": pss / case.nbytes,
        }
    once = max(warm[r].seconds[0] for r in timed_ranks(case, ranks.n))
    return {"iters": max(1, min(2000, round(target / max(once, 1e-6)))), "seconds": []}


def _measure(
    sets: dict[System, Ranks], case: Case, repeats: int, target: float, first: int
) -> dict[System, dict[str, Any]]:
    """Warm both systems up, then time them batch by batch, taking turns.

    Alternating single batches (and which system goes first) spreads the load
    of a shared machine over both systems alike.
    """
    order = SYSTEMS if first % 2 == 0 else SYSTEMS[::-1]
    res = {system: _warm_up(sets[system], case, target) for system in order}
    if case.op == "memory":
        return res
    for i in range(repeats):
        for system in order if i % 2 == 0 else order[::-1]:
            out = res[system]
            if "error" in out:
                continue
            reports = sets[system].run(Run(case, out["iters"], 1))
            error = _errors(sets[system], reports)
            if error:
                res[system] = {"error": error}
                continue
            assert reports is not None
            out["seconds"].append(
                max(reports[r].seconds[0] for r in timed_ranks(case, sets[system].n))
            )
    for out in res.values():
        if "error" not in out:
            out["summary_s"] = summarize(out["seconds"])
    return res


def bench(
    world_sizes: Sequence[int],
    repeats: int,
    target: float,
    mode: Mode = "full",
    only: Sequence[str] = (),
    case_list: Sequence[Case] | None = None,
) -> dict[str, Any]:
    """Time every case of ``mode`` at each world size, both systems; return plain data.

    ``target`` is the wanted duration of one timed batch, in seconds.
    ``case_list`` runs these cases instead of ``mode``'s (``only`` still
    filters them by op): ``SMALL_CASES``, for one.
    """
    chosen = (
        cases(mode, only)
        if case_list is None
        else [c for c in case_list if not only or c.op in only]
    )
    ctx = rank_context()
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        server = AiodistServer()
        server.start()
        stack.callback(server.stop)
        for n in world_sizes:
            started = now()
            sets: dict[System, Ranks] = {
                "gloo": Ranks(ctx, "gloo", n, str(_free_port())),
                "aiodist": Ranks(ctx, "aiodist", n, f"tcp://{HOST}:{server.port}"),
            }
            for ranks in sets.values():
                stack.callback(ranks.close)
            for ranks in sets.values():
                ranks.wait_up()
            print(f"world size {n}: {2 * n} ranks up in {now() - started:.1f} s", flush=True)
            done: set[tuple[str, int]] = set()
            for i, case in enumerate(chosen):
                # Below 4 bytes per rank, all_gather and reduce_scatter sizes collapse into one.
                if (case.op, moved_bytes(case, n)) in done:
                    continue
                done.add((case.op, moved_bytes(case, n)))
                t0 = now()
                row: dict[str, Any] = {"world_size": n, "case": case.name, "op": case.op}
                row["nbytes"] = moved_bytes(case, n)
                row.update({str(k): v for k, v in _measure(sets, case, repeats, target, i).items()})
                _add_ratios(row, n)
                results.append(row)
                print(f"  {_line(row)}  [{now() - t0:.1f} s]", flush=True)
            for ranks in sets.values():  # both systems tear down at once
                ranks.stop()
            for ranks in sets.values():
                ranks.close()
    return {
        "config": {
            "world_sizes": list(world_sizes),
            "repeats": repeats,
            "batch_target_s": target,
            "mode": mode,
            "cases": [c.name for c in chosen],
            "host": HOST,
            "aiodist_loop": "uvloop",
            "environment_overrides": {k: os.environ.get(k) for k in DNS_WORKAROUND},
        },
        "results": results,
    }


def _median(res: dict[str, Any]) -> float | None:
    summary = res.get("summary_s")
    return None if summary is None else float(summary.median)


def _add_ratios(row: dict[str, Any], n: int) -> None:
    if row["op"] == "memory":
        g, a = row["gloo"].get("extra_bytes"), row["aiodist"].get("extra_bytes")
        row["ratio"] = a / g if g and a is not None else None
        return
    g, a = _median(row["gloo"]), _median(row["aiodist"])
    row["time_ratio"] = a / g if a is not None and g else None
    factor = bus_factor(row["op"], n)
    if factor is None:
        return
    for system in SYSTEMS:
        t = _median(row[system])
        if t is not None:
            row[system]["busbw_gbps"] = row["nbytes"] / t * factor / 1e9
    if a is not None and g is not None:
        row["busbw_ratio"] = g / a  # same bytes: bandwidth ratio is the inverse time ratio


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def _cells(res: dict[str, Any], memory: bool) -> list[str]:
    if "error" in res:
        return [f"FAILED: {res['error'][:40]}", "", ""]
    if memory:
        return [
            f"{res['extra_bytes'] / MiB:.1f} MiB",
            f"{res['extra_tensor_sizes']:.2f}x",
            f"PSS {res['pss_extra_tensor_sizes']:.2f}x",
        ]
    s = res["summary_s"]
    bw = res.get("busbw_gbps")
    return [_us(s.median), f"{_us(s.min)}-{_us(s.max)}", "" if bw is None else f"{bw:.2f}"]


def _line(row: dict[str, Any]) -> str:
    parts = [f"N={row['world_size']} {row['case']:<28}"]
    for system in SYSTEMS:
        cells = _cells(row[system], row["op"] == "memory")
        parts.append(f"{system} {cells[0]}" + (f" ({cells[1]})" if cells[1] else ""))
    ratio = row.get("time_ratio", row.get("ratio"))
    if ratio is not None:
        parts.append(f"aiodist/gloo {ratio:.2f}")
    return "  ".join(parts)


def render(data: dict[str, Any]) -> str:
    headers = [
        "case",
        "gloo us",
        "gloo min-max",
        "gloo busbw",
        "aiodist us",
        "aiodist min-max",
        "aiodist busbw",
        "time a/g",
        "busbw a/g",
    ]
    out = []
    for n in data["config"]["world_sizes"]:
        rows = []
        for row in data["results"]:
            if row["world_size"] != n:
                continue
            memory = row["op"] == "memory"
            ratio = row.get("ratio") if memory else row.get("time_ratio")
            bw_ratio = row.get("busbw_ratio")
            rows.append(
                [
                    row["case"],
                    *_cells(row["gloo"], memory),
                    *_cells(row["aiodist"], memory),
                    "-" if ratio is None else f"{ratio:.2f}",
                    "-" if bw_ratio is None else f"{bw_ratio:.2f}",
                ]
            )
        out.append(f"world size {n} (busbw in GB/s; memory rows: extra peak RSS per rank)")
        out.append(format_table(headers, rows))
    out.append(goals(data))
    return "\n\n".join(out)


GOAL_WORLD_SIZE: Final = 4
# (case, ratio key, sense, limit, where the goal was set), at GOAL_WORLD_SIZE.
GOALS: Final[tuple[tuple[str, str, Literal["<=", ">="], float, str], ...]] = (
    ("all_gather_object small dict", "time_ratio", "<=", 0.1, "issue 3"),
    ("barrier", "time_ratio", "<=", 0.2, "issue 3"),
    ("all_reduce 4 B", "time_ratio", "<=", 0.5, "issue 3"),
    ("all_reduce 64 MiB", "busbw_ratio", ">=", 1.5, "issue 3"),
    ("all_reduce 64 MiB", "busbw_ratio", ">=", 2.0, "issue 7"),
    ("all_gather 64 MiB", "busbw_ratio", ">=", 3.0, "issue 7"),
    ("p2p_round_trip 8 B", "time_ratio", "<=", 0.6, "issue 3"),
    ("p2p_bandwidth 64 MiB", "busbw_ratio", ">=", 2.5, "issue 7"),
)
_MEASURES: Final = {"time_ratio": "time aiodist/gloo", "busbw_ratio": "busbw aiodist/gloo"}


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """The project's collective goals, at world size 4 ("not measured" when it was not run)."""
    n = GOAL_WORLD_SIZE
    out = []
    for case, key, sense, limit, source in GOALS:
        row = next((r for r in data["results"] if r["world_size"] == n and r["case"] == case), None)
        value = None if row is None else row.get(key)
        out.append(Goal.judge(f"{case}, N={n}", _MEASURES[key], sense, limit, value, source))
    mem = next((r for r in data["results"] if r["world_size"] == n and r["op"] == "memory"), None)
    value = None
    if mem is not None and "pss_extra_tensor_sizes" in mem["aiodist"]:
        # Proportional set size: shared pages count once across the ranks that map them
        # (peak RSS counts a peer's shared segment in full in every rank that reads it).
        value = max(mem["aiodist"]["pss_extra_tensor_sizes"], 0.0)
    out.append(
        Goal.judge(
            f"memory all_reduce 64 MiB, N={n}",
            "aiodist extra PSS (tensors)",
            "<=",
            1.1,
            value,
            "issue 3",
        )
    )
    return out


def goals(data: dict[str, Any]) -> str:
    """The goals table, as text."""
    return f"goals at world size {GOAL_WORLD_SIZE}\n" + goal_table(goal_list(data))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.bench_collectives``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_collectives", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="default 2 4; with --small 2 4 8 16 (--quick: 2 4 8, --smoke: 2)",
    )
    parser.add_argument("--repeats", type=int, default=None, metavar="K")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--smoke", action="store_true", help="two sizes, one repeat: a check")
    parser.add_argument(
        "--small",
        action="store_true",
        help="only p2p 8 B, barrier and all_reduce 4 B, up to 16 ranks (issue 24's goals)",
    )
    parser.add_argument(
        "--batch-ms", type=float, default=None, help="target time of one timed batch"
    )
    ops = sorted({c.op for c in cases()})
    parser.add_argument("--ops", nargs="+", choices=ops, default=[], help="run only these")
    parser.add_argument(
        "--no-dns-workaround",
        action="store_true",
        help=f"do not set {' '.join(f'{k}={v}' for k, v in DNS_WORKAROUND.items())}",
    )
    args = parser.parse_args(argv)
    mode: Mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    repeats = args.repeats or DEFAULT_REPEATS[mode]
    target = (args.batch_ms or DEFAULT_BATCH_MS[mode]) / 1e3
    world_sizes = args.world_sizes or (SMALL_WORLD_SIZES[mode] if args.small else [2, 4])
    if min(world_sizes) < 2 or repeats < 1:
        parser.error("--world-sizes must be >= 2 and --repeats >= 1")
    if not args.no_dns_workaround:
        for key, value in DNS_WORKAROUND.items():
            os.environ.setdefault(key, value)  # spawned ranks inherit it (TCPStore's lookups)
    started = now()
    print(
        f"{'small messages' if args.small else 'collectives'}, aiodist vs gloo, world sizes "
        f"{list(world_sizes)}, {repeats} batches of ~{target * 1e3:.0f} ms per case",
        flush=True,
    )
    data = bench(world_sizes, repeats, target, mode, args.ops, SMALL_CASES if args.small else None)
    data["config"]["wall_s"] = now() - started
    path = write_results("small" if args.small else "collectives", data)
    print()
    print(render_small(data, goals=True) if args.small else render(data))
    print(f"\nresults: {path} ({data['config']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
