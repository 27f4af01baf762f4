"""Step time of a small CPU training loop with four ways of syncing its metrics.

Every rank trains its own MLP (no gradient sync, so the step's own cost is
what the metric sync adds to) and computes the same metrics each step: loss,
accuracy and a gradient norm per parameter. Variants, run in one job and
interleaved over ``--repeats`` rounds:

- ``none``: the metrics are computed, not synced;
- ``torch_each``: torch.distributed (gloo) blocking ``all_reduce`` of each
  metric, then ``.item()``, every step;
- ``torch_fused``: one blocking gloo ``all_reduce`` of all metrics stacked, every step;
- ``aiodist``: ``MetricAggregator.update`` then ``sync()`` every step, never waited
  for inside the loop (plain code, through ``aiodist.sync``'s loop thread).

The 2% goal is judged on paired blocks: short blocks of ``none`` and
``aiodist`` taken in turn, so that the machine's drift over seconds hits both
alike (its speed moves by more than 2% over the seconds a round takes). Two
reference variants run in the same rotation, to show what any per-step API
costs on this machine before it communicates at all:

- ``read``: the six values read with ``.item()``, nothing else;
- ``local``: a minimal local aggregator, ``update()`` reading the values into a
  list and ``sync()`` returning a handle, with no communication: the floor of
  an ``update``/``sync`` pair in Python.

Each variant's figure is the median over pairs of its block's step time over
``none``'s in the same pair (the slowest rank's, as everywhere here), with a
bootstrap 95% interval of that median: per-pair ratios spread by tens of
percent on shared cores, so a few hundred pairs are what tell 1.02 from 1.03.

Two step sizes run, one after the other, each with all four variants:
``small`` (MLP 128-512-10, batch 64: about 1.6 ms a step with four ranks on
two cores, where every microsecond of the sync shows) and ``large`` (MLP
128-2048-10, batch 256: a step of about 15 ms with four ranks on two cores,
closer to real training). ``--hidden``/``--batch`` and ``--large-hidden``/``--large-batch``
change them; ``--no-large`` skips the second.

Besides the step time, each rank reports its CPU time per step (every thread
of the process, aiodist's loop thread included): ``cpu - none's cpu`` is what
one sync costs a rank in CPU, which is what slows the step when ranks share
cores.

Each rank sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``: four
ranks on a small machine otherwise spin torch's thread pools. TCPStore gets
``RES_OPTIONS=use-vc`` (see ``bench_rendezvous.DNS_WORKAROUND``).

Usage::

    python -m benchmarks.bench_metrics [--ranks 4] [--steps 200] [--repeats 3] [--no-large]

Results go to ``benchmarks/results/metrics.json``; the tables show the median
over rounds of the slowest rank's mean step time (with its spread), ratios to
``none``, and the median over rounds of the ranks' mean CPU time per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Final

from benchmarks._common import (
    Goal,
    format_table,
    goal_table,
    summarize,
    write_results,
)

VARIANTS: Final = ("none", "torch_each", "torch_fused", "aiodist")
PAIRED: Final = ("none", "aiodist", "read", "local")  # in short blocks taken in turn
ENV: Final = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RES_OPTIONS": "use-vc",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}


class _LocalOnly:
    """The ``local`` reference: an update/sync pair that keeps the values and sends nothing."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor  # torch.Tensor
        self._kept: list[Any] = []
        self._single: tuple[tuple[str, ...], list[float]] | None = None

    def update(self, weight: float, /, **values: Any) -> None:
        xs = [weight]
        for value in values.values():
            if type(value) is self._tensor and not value.is_cpu:
                return  # (a GPU value would need another path, as in aiodist)
            xs.append(value.item())
        self._single = (tuple(values), xs)

    def sync(self) -> object:
        handle = (self._single, len(self._kept))
        self._single = None
        self._kept.append(handle)
        if len(self._kept) >= 16:
            self._kept.clear()
        return handle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    import aiodist.sync as dist
    from aiodist.metrics import MetricAggregator

    torch.set_num_threads(1)
    rank, world = args.rank, args.ranks
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.torch_port}", rank=rank, world_size=world
    )
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{args.aiodist_port}", rank=rank, world_size=world, timeout=120
    )
    report: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, hidden, batch in _configs(args):
        report[name] = _measure(args, rank, hidden, batch, torch, tdist, MetricAggregator)
    tdist.barrier()  # rank 0 embeds the rendezvous server: leave together
    dist.destroy_process_group()
    tdist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "configs": report}), flush=True)


def _configs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    out = [("small", args.hidden, args.batch)]
    if not args.no_large:
        out.append(("large", args.large_hidden, args.large_batch))
    return out


def _measure(
    args: argparse.Namespace,
    rank: int,
    hidden: int,
    batch: int,
    torch: Any,
    tdist: Any,
    aggregator: Any,
) -> dict[str, dict[str, list[float]]]:
    """Every variant's seconds and CPU seconds per step, one entry per round."""
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 128)
    y = torch.randint(0, 10, (batch,))
    agg = aggregator()
    local = _LocalOnly(torch.Tensor)

    def train_step() -> dict[str, Any]:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics = {"loss": loss.detach(), "acc": (out.argmax(1) == y).float().mean()}
        for i, p in enumerate(model.parameters()):
            assert p.grad is not None
            metrics[f"grad_norm_{i}"] = p.grad.norm()
        return metrics

    def run(variant: str, steps: int) -> tuple[float, float]:
        tdist.barrier()
        last = None
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            metrics = train_step()
            if variant == "torch_each":
                for t in metrics.values():
                    tdist.all_reduce(t)
                    t.item()
            elif variant == "torch_fused":
                buf = torch.stack(list(metrics.values()))
                tdist.all_reduce(buf)
                buf.tolist()
            elif variant == "aiodist":
                agg.update(batch, **metrics)
                last = agg.sync()
            elif variant == "read":
                for t in metrics.values():
                    t.item()
            elif variant == "local":
                local.update(batch, **metrics)
                local.sync()
        elapsed = time.perf_counter() - start
        if last is not None:
            last.wait(timeout=60)
        # CPU of every thread (the loop thread's too), up to the last sync's end.
        return elapsed / steps, (time.process_time() - cpu) / steps

    for variant in (*VARIANTS, *PAIRED[2:]):  # warm up every path
        run(variant, max(5, args.steps // 10))
    times: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": []} for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            wall, cpu = run(variant, args.steps)
            times[variant]["wall"].append(wall)
            times[variant]["cpu"].append(cpu)
    # Short blocks of every paired variant in turn: the machine's speed drifts by more
    # than 2% over the seconds a round takes, less over one turn. The order rotates and
    # reverses, so that each variant takes every place in a turn equally often.
    paired: dict[str, list[float]] = {v: [] for v in PAIRED}
    pairs = args.pairs if hidden == args.hidden else args.large_pairs
    for k in range(pairs):
        shift = k % len(PAIRED)
        order = PAIRED[shift:] + PAIRED[:shift]
        for variant in order if (k // len(PAIRED)) % 2 == 0 else order[::-1]:
            paired[variant].append(run(variant, args.block)[0])
    times["paired"] = paired
    return times


def bench(
    ranks: int = 4,
    steps: int = 200,
    repeats: int = 3,
    *,
    hidden: int = 512,
    batch: int = 64,
    large: tuple[int, int] | None = (2048, 256),
    timeout: float = 900,
    pairs: int = 300,
    large_pairs: int = 40,
    block: int = 20,
) -> dict[str, Any]:
    """Run the four variants on ``ranks`` processes, for the small step and ``large``.

    ``large`` is the (hidden, batch) of the second step size, or None to skip it.
    Per round, a variant's time is the slowest rank's mean step; the summary is
    the median over rounds, with the min and max. The small step's figures are
    also at the top level (``step_seconds``, ``ratio_to_none``).

    Then ``pairs`` turns (``large_pairs`` for the large step) of ``block``-step
    blocks of each ``PAIRED`` variant: the goal is judged on the median of the
    per-turn ratios of aiodist to none, which a machine whose speed drifts over
    seconds disturbs far less.
    """
    torch_port, aiodist_port = _free_port(), _free_port()
    env = {**os.environ, **ENV}
    config = {
        "ranks": ranks,
        "steps": steps,
        "repeats": repeats,
        "hidden": hidden,
        "batch": batch,
        "pairs": pairs,
        "large_pairs": large_pairs,
        "block": block,
    }
    rank_args = [f"--{k.replace('_', '-')}={v}" for k, v in config.items()]
    rank_args += [f"--torch-port={torch_port}", f"--aiodist-port={aiodist_port}"]
    if large is None:
        rank_args.append("--no-large")
    else:
        rank_args += [f"--large-hidden={large[0]}", f"--large-batch={large[1]}"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_metrics", *rank_args, f"--rank={r}"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(ranks)
    ]
    reports = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"a metrics rank exited with {p.returncode}")
            line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
            reports.append(json.loads(line.removeprefix("RESULT ")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    sizes = {"small": (hidden, batch), **({"large": large} if large is not None else {})}
    configs = {name: _summarize(name, h, b, repeats, reports) for name, (h, b) in sizes.items()}
    return {
        "config": {**config, "large": large, "timeout": timeout},
        "step_seconds": configs["small"]["step_seconds"],
        "ratio_to_none": configs["small"]["ratio_to_none"],
        "configs": configs,
        "per_rank": reports,
        "threads": "OMP_NUM_THREADS=1, torch.set_num_threads(1)",
    }


def _summarize(
    name: str, hidden: int, batch: int, repeats: int, reports: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per round, the slowest rank's mean step (then the median over rounds); CPU likewise."""
    per_rank = [r["configs"][name] for r in reports]
    rounds = range(repeats)
    per_round = {v: [max(r[v]["wall"][i] for r in per_rank) for i in rounds] for v in VARIANTS}
    step = {v: statistics.median(per_round[v]) for v in VARIANTS}
    cpu = {
        v: statistics.median(statistics.mean(r[v]["cpu"][i] for r in per_rank) for i in rounds)
        for v in VARIANTS
    }
    # Per turn, the slowest rank's mean step of each variant; its ratio to none's.
    pairs = range(len(per_rank[0]["paired"]["none"]))
    ratios = {
        v: [
            max(r["paired"][v][k] for r in per_rank) / max(r["paired"]["none"][k] for r in per_rank)
            for k in pairs
        ]
        for v in PAIRED[1:]
    }
    paired = ratios["aiodist"]
    return {
        "hidden": hidden,
        "batch": batch,
        "step_seconds": step,
        "step_summary_s": {v: summarize(per_round[v]) for v in VARIANTS},
        "ratio_to_none": {v: step[v] / step["none"] for v in VARIANTS},
        "cpu_seconds_per_step": cpu,
        "paired_ratios": paired,
        "paired_ratio": statistics.median(paired) if paired else math.nan,
        "paired_summary": summarize(paired) if paired else None,
        "paired_interval": median_interval(paired) if paired else None,
        "reference_ratios": {v: ratios[v] for v in PAIRED[2:]},
        "reference": {
            v: [statistics.median(ratios[v]), *median_interval(ratios[v])] if paired else None
            for v in PAIRED[2:]
        },
    }


def median_interval(samples: list[float], resamples: int = 1000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``samples`` (seeded: the same every time)."""
    rng = random.Random(6)
    medians = sorted(
        statistics.median(rng.choices(samples, k=len(samples))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def render(data: dict[str, Any]) -> str:
    """One step-time table per step size, as text."""
    cfg = data["config"]
    tables = []
    for name, c in data["configs"].items():
        step, cpu, spread = c["step_seconds"], c["cpu_seconds_per_step"], c["step_summary_s"]
        rows = [
            [
                v,
                f"{step[v] * 1e3:.3f}",
                spread[v].spread(1e3, 3),
                f"{step[v] / step['none']:.3f}",
                f"{step[v] / step['torch_each']:.3f}",
                f"{cpu[v] * 1e3:.3f}",
                f"{(cpu[v] - cpu['none']) * 1e6:+.0f}",
            ]
            for v in VARIANTS
        ]
        title = (
            f"[{name}] metric sync every step: {cfg['ranks']} ranks (CPU), MLP "
            f"128-{c['hidden']}-10, batch {c['batch']}, {2 + 4} metrics, {cfg['steps']} steps x "
            f"{cfg['repeats']} rounds; OMP_NUM_THREADS=1 and torch.set_num_threads(1) in every rank"
        )
        headers = [
            "variant",
            "step ms",
            "min-max",
            "vs none",
            "vs torch_each",
            "cpu ms/step",
            "cpu us vs none",
        ]
        tables.append(title + "\n" + format_table(headers, rows) + _paired_note(c, cfg["block"]))
    return "\n\n".join(tables)


def _paired_note(c: dict[str, Any], block: int) -> str:
    if c.get("paired_interval") is None:
        return ""
    low, high = c["paired_interval"]
    lines = [
        f"\npaired: {len(c['paired_ratios'])} turns of {block}-step blocks, "
        f"aiodist/none median {c['paired_ratio']:.3f} (95% interval {low:.3f}-{high:.3f})"
    ]
    for v, (median, low, high) in c["reference"].items():
        lines.append(f"  reference {v}/none: median {median:.3f} ({low:.3f}-{high:.3f})")
    return "\n".join(lines)


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """aiodist's aggregator costs the step at most 2% (issue 6), at each step size."""
    return [
        Goal.judge(
            f"metrics every step, {data['config']['ranks']} ranks, {name} step "
            f"({c['step_seconds']['none'] * 1e3:.1f} ms)",
            "step time aiodist/none (paired blocks)",
            "<=",
            1.02,
            c["paired_ratio"],
            "issue 6",
        )
        for name, c in data["configs"].items()
    ]


def small_step_goal(data: dict[str, Any], source: str) -> Goal:
    """The small step's 2% goal, named by world size: ``metrics small step, N=2``."""
    small = data["configs"].get("small")
    return Goal.judge(
        f"metrics small step, N={data['config']['ranks']}",
        "step time aiodist/none (paired blocks)",
        "<=",
        1.02,
        None if small is None else small["paired_ratio"],
        source,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--large-hidden", type=int, default=2048)
    parser.add_argument("--large-batch", type=int, default=256)
    parser.add_argument("--no-large", action="store_true", help="only the small step")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--pairs", type=int, default=300, help="turns of paired blocks, small")
    parser.add_argument("--large-pairs", type=int, default=40, help="the same, large step")
    parser.add_argument("--block", type=int, default=20, help="steps per paired block")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--torch-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--aiodist-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank_main(args)
        return
    data = bench(
        args.ranks,
        args.steps,
        args.repeats,
        hidden=args.hidden,
        batch=args.batch,
        large=None if args.no_large else (args.large_hidden, args.large_batch),
        timeout=args.timeout,
        pairs=args.pairs,
        large_pairs=args.large_pairs,
        block=args.block,
    )
    print(render(data))
    print(goal_table(goal_list(data)))
    print(f"wrote {write_results('metrics', data)}")


if __name__ == "__main__":
    main()
