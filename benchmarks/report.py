"""Run every benchmark and write one report: aiodist against torch.distributed, side by side.

Sections, run one after another in this process (each spawns its own ranks
and servers, and stops them before the next starts):

- ``collectives``: all_reduce, broadcast, all_gather, reduce_scatter over
  4 B ... 64 MiB, barrier, object collectives, point-to-point latency and
  bandwidth, memory; aiodist vs gloo at world sizes 2 and 4
  (``bench_collectives``);
- ``small``: small messages at the loopback ceiling (issue 24): an 8 B
  round trip, a barrier and a 4 B all_reduce at world sizes 2, 4, 8 and 16,
  vs gloo, and how the barrier grows with the ranks (``bench_collectives``
  with ``_small.SMALL_CASES``);
- ``rendezvous``: N clients joining, up to 1024, vs TCPStore (``bench_rendezvous``);
- ``rendezvous_sim``: the join-storm simulator, N lightweight ranks with
  pre-encoded frames up to 64K, on aiodist's server and TCPStore's
  (``bench_rendezvous --sim``, ``rdzv_sim.py``);
- ``bridge``: event-loop lag during a bridged all_reduce vs torch.distributed
  called in the loop, and training overlap (``bench_bridge``);
- ``metrics``: step time with per-step metric sync, 4 ranks (small and large
  step) and 2 ranks (small step) (``bench_metrics``);
- ``load``: thousands of control connections on one server (``bench_load``);
- ``rpc``: remote calls vs torch.distributed.rpc (TensorPipe): no-op round
  trip, calls/s with 64 in flight, a 4 MiB tensor argument (``bench_rpc``);
- ``remote``: master-worker mode, updates of a tensor held by a worker issued
  without waiting, vs the same update as remote calls one by one and all at
  once (``bench_remote``; not part of ``--smoke``);
- ``recorder``: the flight recorder's cost on a 4 B all_reduce and an 8 B
  round trip, on and off in alternating pairs (A B B A) (``bench_recorder``).
- ``torch``: torch.distributed's all_reduce through the aiodist backend vs gloo
  vs aiodist's own API at 2 and 4 ranks (the collectives' sizes), and a DDP
  training step (a small MLP, a small transformer) on the backend vs gloo,
  alternating (``bench_torch_backend``; not part of ``--smoke``).
- ``tls``: p2p and all_reduce of 64 MiB between two network namespaces on a
  veth pair, mutual TLS vs clear TCP vs gloo, in alternating runs
  (``bench_tls``; skipped, saying why, where namespaces are not permitted;
  not part of ``--smoke``).

Output, in ``--out`` (default ``benchmarks/results/``, which git ignores):
``report.md`` (header with machine facts and goals met, then every table),
``report.json`` (everything, machine-readable), ``busbw_ws{N}.png`` (bus
bandwidth vs message size per world size, needs matplotlib: the ``bench``
extra), and each section's own JSON.

Modes: the full run (about 5-7 minutes on 2 busy cores), ``--quick`` (about 2-3),
``--smoke`` (a few seconds of measuring: two sizes, world size 2, one repeat,
no bridge, metrics or recorder; plots only when matplotlib is installed), which the
test suite runs to keep this script working.

Usage::

    python -m benchmarks.report [--quick | --smoke] [--out DIR] [--sections NAME ...]

Exit status: 0 when every section ran (goals missed or not), 1 when one failed
(the report is written all the same and says which).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from benchmarks import (
    _small,
    bench_bridge,
    bench_collectives,
    bench_load,
    bench_metrics,
    bench_recorder,
    bench_remote,
    bench_rendezvous,
    bench_rpc,
    bench_tls,
    bench_torch_backend,
    rdzv_sim,
)
from benchmarks._common import (
    RESULTS_DIR,
    environment,
    goal_table,
    jsonable,
    now,
    raise_fd_limit,
    write_results,
)
from benchmarks._plots import have_matplotlib, plot_busbw
from benchmarks._report_md import render_report

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from benchmarks._collective_ranks import Mode
    from benchmarks._common import Goal

SECTIONS: Final = (
    "collectives",
    "small",
    "rendezvous",
    "rendezvous_sim",
    "bridge",
    "metrics",
    "load",
    "rpc",
    "remote",
    "recorder",
    "torch",
    "tls",
)


@dataclass(frozen=True, slots=True)
class Plan:
    """How much each section measures in one mode."""

    world_sizes: tuple[int, ...]
    collective_repeats: int
    batch_ms: float
    rendezvous_sizes: tuple[int, ...]
    rendezvous_repeats: int | None  # None: more where runs are cheap
    rendezvous_workers: int
    bridge: tuple[int, int, int] | None  # repeats, size in MiB, training steps
    metrics: tuple[int, int] | None  # steps, rounds
    load: tuple[int, int, int]  # connections, jobs, rounds
    rpc: tuple[int, float]  # alternating pairs per case, batch milliseconds
    small_world_sizes: tuple[int, ...]  # small messages (same repeats and batches as collectives)
    # The flight recorder's cost: A B B A pairs, calls per block (None: not in this mode).
    recorder: tuple[int, int] | None = (25, 800)
    sim_sizes: tuple[int, ...] = rdzv_sim.SIM_SIZES  # the join-storm simulator
    # Master-worker mode: rounds, updates per round, remote calls per round (None: not run).
    remote: tuple[int, int, int] | None = (7, 4000, 1000)


PLANS: Final[dict[Mode, Plan]] = {
    "full": Plan(
        (2, 4),
        7,
        40.0,
        (16, 128, 1024),
        None,
        4,
        (7, 64, 20),
        (200, 3),
        (2000, 100, 3),
        (15, 300.0),
        _small.SMALL_WORLD_SIZES["full"],
    ),
    "quick": Plan(
        (2, 4),
        3,
        10.0,
        (16, 128),
        2,
        4,
        (2, 64, 5),
        (50, 2),
        (400, 20, 2),
        (7, 120.0),
        _small.SMALL_WORLD_SIZES["quick"],
        (9, 500),
        (1024, 4096),
        (3, 2000, 500),
    ),
    "smoke": Plan(
        (2,),
        1,
        5.0,
        (4,),
        1,
        1,
        None,
        None,
        (20, 2, 1),
        (1, 20.0),
        _small.SMALL_WORLD_SIZES["smoke"],
        None,
        (64,),
        None,
    ),
}


def open_files_limit() -> int:
    """This process's soft limit of open files (the simulator's servers inherit it)."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _run_section(name: str, plan: Plan, mode: Mode) -> tuple[dict[str, Any], list[Goal], str]:
    """Run one section; return its data, its goals and its text tables."""
    if name == "collectives":
        data = bench_collectives.bench(
            plan.world_sizes, plan.collective_repeats, plan.batch_ms / 1e3, mode
        )
        return data, bench_collectives.goal_list(data), bench_collectives.render(data)
    if name == "small":
        data = bench_collectives.bench(
            plan.small_world_sizes,
            plan.collective_repeats,
            plan.batch_ms / 1e3,
            mode,
            case_list=_small.SMALL_CASES,
        )
        return data, _small.goal_list(data), _small.render(data)
    if name == "rendezvous":
        data = bench_rendezvous.bench(
            plan.rendezvous_sizes,
            plan.rendezvous_repeats,
            workers=plan.rendezvous_workers,
            timeout=bench_rendezvous.DEFAULT_RUN_TIMEOUT,
        )
        return data, bench_rendezvous.goal_list(data), bench_rendezvous.render(data)
    if name == "rendezvous_sim":
        data = rdzv_sim.sim_bench(plan.sim_sizes, 1, open_files=open_files_limit())
        return data, rdzv_sim.sim_goals(data), rdzv_sim.render_sim(data)
    if name == "bridge":
        assert plan.bridge is not None
        data = bench_bridge.bench(*plan.bridge)
        return data, bench_bridge.goal_list(data), bench_bridge.render(data)
    if name == "metrics":
        assert plan.metrics is not None
        steps, rounds = plan.metrics
        data = bench_metrics.bench(4, steps, rounds)
        # Issue 24 judges the small step at world size 2 as well: a run of its own, small only.
        two = data["world_size_2"] = bench_metrics.bench(2, steps, rounds, large=None)
        goals = [*bench_metrics.goal_list(data), bench_metrics.small_step_goal(two, "issue 24")]
        text = f"{bench_metrics.render(data)}\n\n{bench_metrics.render(two)}"
        return data, goals, text
    if name == "load":
        data = bench_load.bench(*plan.load)
        return data, bench_load.goal_list(data), bench_load.render(data)
    if name == "rpc":
        pairs, batch_ms = plan.rpc
        data = bench_rpc.bench(pairs, batch_ms, mode=mode)
        return data, bench_rpc.goal_list(data), bench_rpc.render(data)
    if name == "remote":
        assert plan.remote is not None
        data = bench_remote.bench(*plan.remote)
        return data, bench_remote.goal_list(data), bench_remote.render(data)
    if name == "recorder":
        assert plan.recorder is not None
        data = bench_recorder.bench(*plan.recorder)
        return data, bench_recorder.goal_list(data), bench_recorder.render(data)
    if name == "torch":
        data = bench_torch_backend.bench(mode, (2, 4))
        return data, bench_torch_backend.goal_list(data), bench_torch_backend.render(data)
    if name == "tls":
        data = bench_tls.bench(rounds=2 if mode == "full" else 1)
        return data, bench_tls.goal_list(data), bench_tls.render(data)
    raise ValueError(f"unknown section {name!r}")


def _skip_reason(name: str, plan: Plan, mode: Mode, chosen: Sequence[str]) -> str | None:
    if name not in chosen:
        return "not chosen with --sections"
    if name == "torch" and mode == "smoke":
        return "not part of --smoke (it starts its ranks and a DDP model of its own)"
    if name == "tls" and mode == "smoke":
        return "not part of --smoke (it makes network namespaces and spawns six pairs of ranks)"
    if (
        (name == "bridge" and plan.bridge is None)
        or (name == "metrics" and plan.metrics is None)
        or (name == "recorder" and plan.recorder is None)
        or (name == "remote" and plan.remote is None)
    ):
        return f"not part of --{mode} (it spawns several more jobs)"
    return None


def run(
    mode: Mode,
    out: Path,
    chosen: Sequence[str] = SECTIONS,
    plots: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the chosen sections of ``mode``, write the report into ``out``; return it as data."""
    plan = PLANS[mode]
    out.mkdir(parents=True, exist_ok=True)
    started = now()
    env = environment()  # before anything runs: the load average is others' work
    sections: dict[str, dict[str, Any]] = {}
    goals: list[Goal] = []
    for name in SECTIONS:
        reason = _skip_reason(name, plan, mode, chosen)
        if reason is not None:
            sections[name] = {"skipped": reason}
            continue
        log(f"== {name} ({mode})")
        t0 = now()
        try:
            data, section_goals, text = _run_section(name, plan, mode)
        except Exception as exc:
            error = "".join(traceback.format_exception_only(exc)).strip()
            sections[name] = {"error": error[-2000:], "wall_s": now() - t0}
            log(f"{name} FAILED after {now() - t0:.0f} s: {error}")
            continue
        sections[name] = {"data": data, "wall_s": now() - t0}
        goals += section_goals
        write_results(name, data, out)
        log(f"{text}\n{goal_table(section_goals)}\n{name}: {now() - t0:.0f} s\n")
    plot_files: dict[int, str] = {}
    plot_note = None
    collectives = sections["collectives"].get("data")
    if collectives is not None and plots and have_matplotlib():
        for path in plot_busbw(collectives, out):
            plot_files[int(path.stem.removeprefix("busbw_ws"))] = path.name
    elif collectives is not None:
        plot_note = (
            "Plots skipped: --no-plots."
            if not plots
            else "Plots skipped: matplotlib is not installed (pip install -e '.[bench]')."
        )
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.report", *sys.argv[1:]]),
        "mode": mode,
        "environment": env,
        "plan": asdict(plan),
        "sections": sections,
        "goals": goals,
        "plots": sorted(plot_files.values()),
        "plot_note": plot_note,
        "wall_s": now() - started,
    }
    (out / "report.md").write_text(render_report(report, goals, plot_files))
    text = json.dumps(report, indent=2, default=jsonable) + "\n"
    (out / "report.json").write_text(text)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.report``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0]
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer sizes and repeats: < 2 min")
    size.add_argument("--smoke", action="store_true", help="the smallest run that writes it all")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the report goes")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="NAME"
    )
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    args = parser.parse_args(argv)
    mode: Mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    if not args.no_plots and mode != "smoke" and not have_matplotlib():
        parser.error(
            "the plots need matplotlib: pip install -e '.[bench]' (or `make bench`), "
            "or pass --no-plots"
        )
    for key, value in bench_rendezvous.DNS_WORKAROUND.items():
        os.environ.setdefault(key, value)  # every spawned rank and store inherits it
    plan = PLANS[mode]
    raise_fd_limit(2 * max(max(plan.rendezvous_sizes), max(plan.sim_sizes), plan.load[0]) + 1024)
    report = run(mode, args.out, args.sections, plots=not args.no_plots)
    print(goal_table(report["goals"]))
    print(f"\nreport: {args.out / 'report.md'} ({report['wall_s']:.0f} s)")
    return 1 if any("error" in s for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
