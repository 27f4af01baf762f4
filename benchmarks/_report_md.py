"""The benchmark report as Markdown: header, goals, and one table per measurement.

Every row puts aiodist's figure next to its counterpart's (torch.distributed
gloo, or torch's TCPStore for rendezvous) measured in the same run, with the
ratio; a figure reads ``median (min-max)`` over the repeats. Works on the
in-memory results and on their JSON form alike (``report.json``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

from benchmarks._collective_ranks import TENSOR_OPS, MiB, bus_factor
from benchmarks._common import Goal, Summary, as_summary
from benchmarks._small import GROWTH_CASE, goal_list, growth, growth_world_size, in_order

if TYPE_CHECKING:
    from collections.abc import Sequence

    from benchmarks._collective_ranks import System

__all__ = ["render_report"]

SECTION_TITLES: Final = {
    "collectives": "Collectives vs torch.distributed gloo",
    "small": "Small messages vs torch.distributed gloo, 2 to 16 ranks",
    "rendezvous": "Rendezvous at scale vs torch TCPStore",
    "rendezvous_sim": "Join storm on the server itself (simulator) vs torch TCPStore",
    "bridge": "Torch bridge: loop lag and overlap",
    "metrics": "Metric sync step time",
    "load": "Server load",
    "rpc": "Remote calls vs torch.distributed.rpc (TensorPipe)",
    "remote": "Master-worker mode vs remote calls",
    "recorder": "Flight recorder cost (on vs off)",
    "torch": "torch.distributed on the aiodist backend vs gloo, and DDP",
}


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    align = ["---", *["---:"] * (len(headers) - 1)]
    lines = [headers, align, *[[str(c) for c in row] for row in rows]]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _count(k: int, noun: str, plural: str = "s") -> str:
    return f"{k} {noun}{'' if k == 1 else plural}"


def _num(x: float) -> str:
    """Three significant figures, no exponent for the ranges we print."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def _spread(s: Summary, scale: float) -> str:
    """`` (min-max)``, or nothing for a single sample."""
    if s.n < 2:
        return ""
    return f" ({_num(s.min * scale)}-{_num(s.max * scale)})"


def _duration(s: Summary | None) -> str:
    """``median (min-max)`` in µs, ms or s, whichever reads best for the median."""
    if s is None:
        return "-"
    unit, scale = ("s", 1.0) if s.median >= 1 else ("ms", 1e3) if s.median >= 1e-3 else ("µs", 1e6)
    return f"{_num(s.median * scale)} {unit}{_spread(s, scale)}"


def _bandwidth(nbytes: int, factor: float, s: Summary | None) -> str:
    """``median (min-max)`` in GB/s, MB/s or kB/s (decimal units, as nccl-tests)."""
    if s is None:
        return "-"
    rate = nbytes * factor / s.median
    unit, scale = next(
        ((u, k) for u, k in (("GB/s", 1e9), ("MB/s", 1e6)) if rate >= k), ("kB/s", 1e3)
    )
    low, high = nbytes * factor / s.max / scale, nbytes * factor / s.min / scale
    spread = f" ({_num(low)}-{_num(high)})" if s.n > 1 else ""
    return f"{_num(rate / scale)} {unit}{spread}"


def _ratio(value: float | None, better: str) -> str:
    """The ratio, in bold where aiodist is the better of the two."""
    if value is None or not math.isfinite(value):
        return "-"
    wins = value < 1 if better == "lower" else value > 1
    text = f"{value:.2f}"
    return f"**{text}**" if wins else text


def _failed(res: dict[str, Any]) -> str | None:
    error = res.get("error")
    return None if error is None else f"failed: {str(error)[:60]}"


def _env_lines(env: dict[str, Any], report: dict[str, Any]) -> list[str]:
    versions = ", ".join(
        f"{k} {env.get(k)}" for k in ("python", "torch", "anyio", "uvloop", "msgpack")
    )
    return [
        f"- **Run**: `{report['command']}`, mode `{report['mode']}`, {env.get('date')}, "
        f"{report['wall_s'] / 60:.1f} min in all",
        f"- **Commit**: `{env.get('git_commit')}`",
        f"- **Machine**: {env.get('cpu_count')} CPUs ({env.get('cpu_model')}), "
        f"{env.get('mem_total_gib')} GiB, {env.get('platform')}; load average "
        f"{env.get('load_avg_1m')} at the start (a shared machine slows both systems alike: "
        "they take turns batch by batch)",
        f"- **Software**: {versions}",
    ]


def _goals(goals: Sequence[Goal]) -> str:
    rows = [
        [
            g.name,
            g.measure,
            g.target,
            "-" if g.value is None else _num(g.value),
            "met" if g.met else "not measured" if g.met is None else "**MISSED**",
            g.source,
        ]
        for g in goals
    ]
    met = sum(1 for g in goals if g.met)
    measured = sum(1 for g in goals if g.met is not None)
    return f"{met} of {measured} measured goals met.\n\n" + _table(
        ["case", "measure", "goal", "value", "verdict", "set in"], rows
    )


# --- collectives --------------------------------------------------------------------------------


def _tensor_rows(results: list[dict[str, Any]], n: int) -> list[list[str]]:
    rows = []
    for op in TENSOR_OPS:
        for row in results:
            if row["world_size"] != n or row["op"] != op:
                continue
            factor = bus_factor(op, n)
            assert factor is not None
            cells = [op, _size(row["nbytes"])]
            for system in ("aiodist", "gloo"):
                res = row[system]
                cells.append(_failed(res) or _duration(as_summary(res.get("summary_s"))))
            cells.append(_ratio(row.get("time_ratio"), "lower"))
            for system in ("aiodist", "gloo"):
                s = as_summary(row[system].get("summary_s"))
                cells.append(_failed(row[system]) or _bandwidth(row["nbytes"], factor, s))
            cells.append(_ratio(row.get("busbw_ratio"), "higher"))
            rows.append(cells)
    return rows


def _other_rows(results: list[dict[str, Any]], n: int) -> list[list[str]]:
    rows = []
    for row in results:
        if row["world_size"] != n or row["op"] in (*TENSOR_OPS, "memory"):
            continue
        cells = [row["case"]]
        if row["op"] == "p2p_bandwidth":
            for system in ("aiodist", "gloo"):
                s = as_summary(row[system].get("summary_s"))
                cells.append(_failed(row[system]) or _bandwidth(row["nbytes"], 1.0, s))
            cells.append(_ratio(row.get("busbw_ratio"), "higher") + " (bandwidth)")
        else:
            for system in ("aiodist", "gloo"):
                res = row[system]
                cells.append(_failed(res) or _duration(as_summary(res.get("summary_s"))))
            cells.append(_ratio(row.get("time_ratio"), "lower") + " (time)")
        rows.append(cells)
    return rows


def _memory_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for row in results:
        if row["op"] != "memory":
            continue
        cells = [str(row["world_size"])]
        for key in ("extra_bytes", "pss_extra_bytes"):
            for system in ("aiodist", "gloo"):
                res = row[system]
                value = res.get(key)
                tensors = value / row["nbytes"] if value is not None else None
                cells.append(
                    _failed(res)
                    or ("-" if value is None else f"{value / MiB:.1f} MiB ({tensors:.2f}x)")
                )
        rows.append(cells)
    return rows


def _collectives(data: dict[str, Any], plots: dict[int, str]) -> list[str]:
    cfg, results = data["config"], data["results"]
    out = [
        f"{cfg['repeats']} timed batches per case and system, each of about "
        f"{cfg['batch_target_s'] * 1e3:.0f} ms of back-to-back calls after a checked warm-up; "
        "a batch's time per call is the slowest rank's. Both systems' ranks are up for the "
        "whole world size and take turns batch by batch. Bus bandwidth follows nccl-tests: "
        "algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter (size = "
        "the whole gathered or scattered buffer), x 1 for broadcast and point-to-point. "
        "Ratios are aiodist/gloo; **bold** where aiodist is better (a lower time, a higher "
        "bandwidth)."
    ]
    for n in cfg["world_sizes"]:
        out.append(f"### World size {n}")
        if n in plots:
            out.append(f"![bus bandwidth, world size {n}]({plots[n]})")
        headers = [
            "op",
            "size",
            "aiodist time",
            "gloo time",
            "time a/g",
            "aiodist busbw",
            "gloo busbw",
            "busbw a/g",
        ]
        out.append(_table(headers, _tensor_rows(results, n)))
        other = _other_rows(results, n)
        if other:
            out.append(f"Barrier, object collectives and point-to-point (ranks 0 and 1), N={n}:")
            out.append(_table(["case", "aiodist", "gloo", "aiodist/gloo"], other))
    memory = _memory_rows(results)
    if memory:
        out.append(
            "Memory during one 64 MiB all_reduce, per rank: how far peak RSS rose, and how much "
            "the proportional set size (shared pages counted once across ranks) grew; in MiB "
            "and in tensor sizes."
        )
        headers = ["N", "aiodist peak RSS", "gloo peak RSS", "aiodist PSS", "gloo PSS"]
        out.append(_table(headers, memory))
    return out


def _small_messages(data: dict[str, Any]) -> list[str]:
    systems: tuple[System, ...] = ("aiodist", "gloo")
    cfg = data["config"]
    rows = []
    for row in in_order(data["results"]):
        n = row["world_size"]
        cells = [row["case"], str(n)]
        for system in ("aiodist", "gloo"):
            res = row[system]
            cells.append(_failed(res) or _duration(as_summary(res.get("summary_s"))))
        cells.append(_ratio(row.get("time_ratio"), "lower"))
        for system in systems:
            g = growth(data, row["case"], system, n)
            cells.append("-" if g is None else f"{g:.2f}")
        rows.append(cells)
    m = growth_world_size(data)
    shown = {s: growth(data, GROWTH_CASE, s, m) for s in systems}
    growths = ", ".join(f"{s} {'-' if g is None else f'{g:.2f}x'}" for s, g in shown.items())
    return [
        "Per-call cost where the bytes are nothing (issue 24): an 8-byte round trip between "
        "ranks 0 and 1, a barrier, a 4-byte all_reduce; every world size's ranks of both "
        f"systems up together. {_count(cfg['repeats'], 'timed batch', 'es')} per case and "
        f"system of about {cfg['batch_target_s'] * 1e3:.0f} ms of back-to-back calls after a "
        "checked warm-up, taken in turns; a batch's time per call is the slowest rank's. "
        "**Bold**: aiodist faster. `x N=2`: the time over the same case's at world size 2; "
        "a cost growing as log2(N) gives 2, 3 and 4 at N=4, 8 and 16.",
        _table(
            ["case", "N", "aiodist", "gloo", "aiodist/gloo", "aiodist x N=2", "gloo x N=2"],
            rows,
        ),
        f"Barrier growth from N=2 to N={m}: {growths} "
        f"(log2({m})/log2(2) = {math.log2(m):g}; gloo's for reference).",
        "Issue 24's goals: " + _goals(goal_list(data)),
    ]


# --- the other sections -------------------------------------------------------------------------


def _rendezvous(data: dict[str, Any]) -> list[str]:
    rows, phase_rows = [], []
    for res in data["results"]:
        n = res["world_size"]
        a = as_summary(res.get("aiodist", {}).get("summary_s"))
        t = as_summary(res.get("tcpstore", {}).get("summary_s"))
        ratio = a.median / t.median if a is not None and t is not None else None
        rows.append([str(n), _duration(a), _duration(t), _ratio(ratio, "lower")])
        for system in ("aiodist", "tcpstore"):
            phases = res.get(system, {}).get("phases_s", {})
            shown = []
            for p in data["phases"]:
                s = as_summary(phases.get(p))
                shown.append("-" if s is None else f"{s.median * 1e3:.1f}")
            phase_rows.append([str(n), system, *shown])
    cfg = data["config"]
    return [
        f"N clients join, set a key, wait for all N keys and pass a barrier; clients spread "
        f"over {_count(cfg['workers'], 'worker process', 'es')} (aiodist: tasks on a uvloop "
        "loop; TCPStore: threads), each server in its own process. Time from release to the "
        "last client past the barrier; ratio aiodist/TCPStore (below 1: aiodist faster).",
        _table(["N", "aiodist", "TCPStore", "time a/t"], rows),
        "When the last client finished each step (median, ms after the start):",
        _table(["N", "system", *(f"{p} ms" for p in data["phases"])], phase_rows),
    ]


def _rendezvous_sim(data: dict[str, Any]) -> list[str]:
    rows = []
    for res in data["results"]:
        cells = [str(res["world_size"])]
        for system in ("aiodist", "tcpstore"):
            entry = res.get(system) or {}
            s = as_summary(entry.get("summary_s"))
            errors = entry.get("errors") or []
            cells.append(_duration(s) if s is not None else (errors[0][:60] if errors else "-"))
        ratio = res.get("ratio_tcpstore_over_aiodist")
        cells.append("-" if ratio is None else f"{ratio:.2f}x")
        rows.append(cells)
    cfg = data["config"]
    return [
        "N simulated ranks (plain sockets, pre-encoded frames, "
        f"{_count(cfg['workers'], 'worker process', 'es')}) join one job, set a key and get "
        "a neighbour's, and pass a barrier, on each server in its own process. Time from "
        "release to the last rank past the barrier; TCPStore/aiodist above 1: aiodist faster.",
        _table(["N", "aiodist", "TCPStore", "TCPStore/aiodist"], rows),
    ]


def _bridge(data: dict[str, Any]) -> list[str]:
    lag = data["loop_lag"]
    a, t = lag["bridged"], lag["naive"]

    def row(label: str, key: str, better: str = "lower") -> list[str]:
        ratio = a[key] / t[key] if t[key] else None
        shown = [str(x) if isinstance(x, int) else _num(x) for x in (a[key], t[key])]
        return [label, *shown, _ratio(ratio, better)]

    op = [
        f"all_reduce {data['size_mib']} MiB, ms",
        f"{_num(a['op_median_ms'])} ({_num(a['op_min_ms'])}-{_num(a['op_max_ms'])})",
        f"{_num(t['op_median_ms'])} ({_num(t['op_min_ms'])}-{_num(t['op_max_ms'])})",
        _ratio(a["op_median_ms"] / t["op_median_ms"], "lower"),
    ]
    train = data["training"]
    return [
        f"Two ranks (`aiodist run -n 2`, gloo on CPU) all-reduce {data['size_mib']} MiB "
        f"{data['repeats']} times while a task on rank 0's loop sleeps 1 ms at a time and "
        "records how late it wakes: through aiodist's bridge, and with torch.distributed's "
        "all_reduce called inside the coroutine (which blocks the loop).",
        _table(
            ["", "aiodist (bridged)", "torch.distributed in the loop", "aiodist/torch"],
            [
                op,
                row("loop lag p50, ms", "lag_p50_ms"),
                row("loop lag p99, ms", "lag_p99_ms"),
                row("loop lag max, ms", "lag_max_ms"),
                row("ticks seen", "ticks", "higher"),
            ],
        ),
        f"Training overlap (`examples/train_overlap.py`, 4 ranks, {data['steps']} steps, median "
        f"step): overlap efficiency {train['overlap_efficiency']:.0%} of the communication time "
        "hidden.",
        _table(
            ["mode", "ms/step"],
            [[m, _num(train[m] * 1e3)] for m in ("overlap", "blocking", "none")],
        ),
    ]


def _metrics(data: dict[str, Any]) -> list[str]:
    two = data.get("world_size_2")
    if two is None:
        return _metrics_run(data)
    return [
        f"### World size {data['config']['ranks']}",
        *_metrics_run(data),
        "### World size 2, small step (issue 24)",
        *_metrics_run(two),
    ]


def _metrics_run(data: dict[str, Any]) -> list[str]:
    cfg = data["config"]
    out = [
        f"{cfg['ranks']} ranks on CPU each train an MLP and sync 6 metrics every step: not at "
        "all, torch.distributed blocking all_reduce per metric, one fused all_reduce, or "
        f"aiodist's MetricAggregator (never waited for in the loop). {cfg['steps']} steps x "
        f"{cfg['repeats']} rounds; the slowest rank's mean step per round. CPU is the ranks' "
        "mean CPU time per step, every thread included: what a sync costs when ranks share cores."
    ]
    for name, c in data["configs"].items():
        step, cpu = c["step_seconds"], c["cpu_seconds_per_step"]
        rows = []
        for v in ("none", "torch_each", "torch_fused", "aiodist"):
            s = as_summary(c["step_summary_s"][v])
            rows.append(
                [
                    v,
                    _duration(s),
                    _num(step[v] / step["none"]),
                    _ratio(step["aiodist"] / step[v], "lower") if v != "aiodist" else "",
                    f"{(cpu[v] - cpu['none']) * 1e6:+.0f} µs",
                ]
            )
        out += [
            f"**{name} step** (MLP 128-{c['hidden']}-10, batch {c['batch']}):",
            _table(["variant", "step", "vs none", "aiodist/this", "CPU vs none"], rows),
        ]
        if c.get("paired_interval") is not None:
            low, high = c["paired_interval"]
            refs = "; ".join(
                f"{v}/none {_num(median)} ({_num(lo)}-{_num(hi)})"
                for v, (median, lo, hi) in c["reference"].items()
            )
            out.append(
                f"Paired blocks ({len(c['paired_ratios'])} turns of {cfg['block']}-step blocks "
                f"of none, aiodist and two references): aiodist/none median "
                f"{_num(c['paired_ratio'])} (95% interval {_num(low)}-{_num(high)}); the goal "
                f"is judged on this. References, what any per-step API costs here before it "
                f"communicates: {refs} (`read`: the values read alone; `local`: an "
                "update/sync pair that keeps them and sends nothing)."
            )
    return out


def _load(data: dict[str, Any]) -> list[str]:
    cfg = data["config"]
    rows = [
        [
            str(i),
            str(r["held_at_once"]),
            str(r["jobs_formed"]),
            f"{r['seconds']:.2f}",
            f"{r['peak_kib'] / 1024:.1f}",
            f"{r['rss_kib'] / 1024:.1f}",
        ]
        for i, r in enumerate(data["rounds"])
    ]
    return [
        f"{cfg['connections']} control clients over {cfg['jobs']} jobs on one `aiodist serve` "
        "(join, store set/add/wait, barrier, hold until every member is in, leave), "
        f"{_count(cfg['rounds'], 'round')}; server baseline {data['baseline_kib'] / 1024:.1f} MiB. "
        "No torch counterpart.",
        _table(["round", "held at once", "jobs formed", "seconds", "peak MiB", "after MiB"], rows),
    ]


def _rpc(data: dict[str, Any]) -> list[str]:
    from benchmarks.bench_rpc import rows

    cfg = data["config"]
    return [
        "A master and a worker per system, all four processes up; the systems take turns "
        f"in {_count(cfg['pairs'], 'alternating pair')} of ~{_num(cfg['batch_ms'])} ms batches "
        "per case (each goes first equally often) while the other system is stopped "
        "(SIGSTOP: TensorPipe's threads poll even when idle). aiodist: async code on uvloop "
        "awaiting `rpc.rpc_async`; torch: `rpc_sync` / `rpc_async().wait()`; the same plain "
        "functions. Each figure is the median over batches (min-max); the ratio is the median "
        "of the per-pair ratios aiodist/torch (min-max: the spread).",
        _table(["case", "aiodist", "torch", "aiodist/torch"], rows(data)),
    ]


def _remote(data: dict[str, Any]) -> list[str]:
    from benchmarks.bench_remote import CASES, figure

    cfg = data["config"]
    return [
        "One job, a master and a worker: the master adds 1 to a 16-element tensor the "
        f"worker holds, {cfg['ops']} times per round as `x.add_(1)` on an `aiodist.remote` "
        f"tensor (issued, then `remote.synchronize()`), and {cfg['calls']} times as remote "
        "calls of the same update, awaited one by one and all at once; the cases take turns "
        f"over {_count(cfg['rounds'], 'round')}, in alternating order. Median over rounds "
        "(min-max); the ratios are per round.",
        _table(
            ["case", "operations/s"],
            [[case, figure(data["per_second"][case])] for case in CASES],
        ),
        _table(
            ["ratio", "median (min-max)"],
            [[name, figure(s, ratio=True)] for name, s in data["ratios"].items()],
        ),
    ]


def _recorder(data: dict[str, Any]) -> list[str]:
    rows = [
        [
            case,
            f"{c['on_us']:.1f}",
            f"{c['off_us']:.1f}",
            f"{100 * c['cost_median']:+.2f} %",
            f"{100 * c['cost_min']:+.2f} .. {100 * c['cost_max']:+.2f} %",
            f"{100 * c['derived']:.2f} %",
        ]
        for case, c in data["costs"].items()
    ]
    own = data["record_ns"]
    return [
        f"Two ranks time each case in {_count(data['pairs'], 'alternating pair')} of "
        f"{data['iters']}-call blocks, recorder on, off, off, on (off: a session without a "
        "recorder, as `AIODIST_RECORDER_SIZE=0`). The cost is the median over the pairs of "
        "(on + on) / (off + off) - 1, with its spread (min..max). The recorder's own time "
        f"per operation, in one process: {own['median']:.0f} ns "
        f"({own['min']:.0f}-{own['max']:.0f}); `derived` is that time for the operations "
        "one rank records per call (1 for the all_reduce, 2 for the round trip) over the "
        "time per call without the recorder: the cost without the machine's noise.",
        _table(["case", "on us/call", "off us/call", "cost", "spread", "derived"], rows),
    ]


def _median_spread(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def _torch_backend(data: dict[str, Any]) -> list[str]:
    out = [
        "torch's own `torch.distributed.all_reduce` on the default group that aiodist's "
        "`init_process_group()` brings up (the aiodist backend), on a gloo group over the same "
        "ranks, and aiodist's own `aiodist.sync.all_reduce`, in palindromes of blocks "
        "(backend, gloo, aiodist, aiodist, gloo, backend); ratios are medians over the "
        "palindromes (spread in brackets). Then a `DistributedDataParallel` step on each "
        "group, A B B A.",
    ]
    for n, ws in data["world_sizes"].items():
        rows = [
            [
                _size(int(size)),
                f"{c['backend_us']:.1f}",
                f"{c['gloo_us']:.1f}",
                f"{c['aiodist_us']:.1f}",
                _median_spread(c.get("vs_gloo")),
                _median_spread(c.get("vs_aiodist")),
                f"{c['backend_us'] - c['aiodist_us']:+.1f}",
            ]
            for size, c in ws["all_reduce"].items()
        ]
        out.append(f"### all_reduce, world size {n}")
        headers = ["size", "backend µs", "gloo µs", "aiodist API µs", "backend/gloo"]
        out.append(_table([*headers, "backend/API", "backend - API µs"], rows))
    rows = [
        [
            name,
            n,
            f"{c['params']:,}",
            f"{c['backend_us'] / 1e3:.2f}",
            f"{c['gloo_us'] / 1e3:.2f}",
            _median_spread(c.get("vs_gloo")),
        ]
        for n, ws in data["world_sizes"].items()
        for name, c in ws["ddp"].items()
    ]
    out.append("### DDP training step (CPU)")
    headers = ["model", "ranks", "params", "aiodist ms/step", "gloo ms/step", "aiodist/gloo"]
    out.append(_table(headers, rows))
    return out


_RENDER: Final = {
    "small": _small_messages,
    "rendezvous": _rendezvous,
    "rendezvous_sim": _rendezvous_sim,
    "bridge": _bridge,
    "metrics": _metrics,
    "load": _load,
    "rpc": _rpc,
    "remote": _remote,
    "recorder": _recorder,
    "torch": _torch_backend,
}


def render_report(report: dict[str, Any], goals: Sequence[Goal], plots: dict[int, str]) -> str:
    """The whole report; ``plots`` maps a world size to its PNG's file name."""
    env = report["environment"]
    out = ["# aiodist benchmark report", "\n".join(_env_lines(env, report))]
    if report.get("plot_note"):
        out.append(f"_{report['plot_note']}_")
    out += ["## Goals", _goals(goals)]
    for name, title in SECTION_TITLES.items():
        section = report["sections"].get(name)
        if section is None:
            continue
        out.append(f"## {title}")
        if "skipped" in section:
            out.append(f"_Not run: {section['skipped']}._")
        elif "error" in section:
            out.append(
                f"**Failed** after {section['wall_s']:.0f} s:\n\n```\n{section['error']}\n```"
            )
        elif name == "collectives":
            out += _collectives(section["data"], plots)
        else:
            out += _RENDER[name](section["data"])
    rows = [
        [
            name,
            "skipped" if "skipped" in s else "FAILED" if "error" in s else "ok",
            f"{s.get('wall_s', 0.0):.0f}",
        ]
        for name, s in report["sections"].items()
    ]
    out += ["## Run", _table(["section", "status", "seconds"], rows)]
    return "\n\n".join(out) + "\n"
