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

Each rank sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``: four
ranks on a small machine otherwise spin torch's thread pools. TCPStore gets
``RES_OPTIONS=use-vc`` (see ``bench_rendezvous.DNS_WORKAROUND``).

Usage::

    python -m benchmarks.bench_metrics [--ranks 4] [--steps 200] [--repeats 3]

Results go to ``benchmarks/results/metrics.json``; the table shows the median
over rounds of the slowest rank's mean step time, and ratios to ``none``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Final

from benchmarks._common import Goal, format_table, goal_table, summarize, write_results

VARIANTS: Final = ("none", "torch_each", "torch_fused", "aiodist")
ENV: Final = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RES_OPTIONS": "use-vc",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}


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
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 128)
    y = torch.randint(0, 10, (args.batch,))
    agg = MetricAggregator()

    def train_step() -> dict[str, torch.Tensor]:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        metrics = {"loss": loss.detach(), "acc": (out.argmax(1) == y).float().mean()}
        for i, p in enumerate(model.parameters()):
            assert p.grad is not None
            metrics[f"grad_norm_{i}"] = p.grad.norm()
        return metrics

    def run(variant: str, steps: int) -> float:
        tdist.barrier()
        last = None
        start = time.perf_counter()
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
                agg.update(args.batch, **metrics)
                last = agg.sync()
        elapsed = time.perf_counter() - start
        if last is not None:
            last.wait(timeout=60)
        return elapsed / steps

    for variant in VARIANTS:  # warm up every path
        run(variant, max(5, args.steps // 10))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            times[variant].append(run(variant, args.steps))
    tdist.barrier()  # rank 0 embeds the rendezvous server: leave together
    dist.destroy_process_group()
    tdist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, "times": times}), flush=True)


def bench(
    ranks: int = 4,
    steps: int = 200,
    repeats: int = 3,
    *,
    hidden: int = 512,
    batch: int = 64,
    timeout: float = 600,
) -> dict[str, Any]:
    """Run the four variants on ``ranks`` processes; return plain data.

    Per round, a variant's time is the slowest rank's mean step; the summary
    is the median over rounds, with the min and max.
    """
    torch_port, aiodist_port = _free_port(), _free_port()
    env = {**os.environ, **ENV}
    config = {"ranks": ranks, "steps": steps, "repeats": repeats, "hidden": hidden, "batch": batch}
    rank_args = [f"--{k}={v}" for k, v in config.items()]
    rank_args += [f"--torch-port={torch_port}", f"--aiodist-port={aiodist_port}"]
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
    per_round = {
        v: [max(r["times"][v][i] for r in reports) for i in range(repeats)] for v in VARIANTS
    }
    step = {v: statistics.median(per_round[v]) for v in VARIANTS}
    return {
        "config": {**config, "timeout": timeout},
        "step_seconds": step,
        "step_summary_s": {v: summarize(per_round[v]) for v in VARIANTS},
        "ratio_to_none": {v: step[v] / step["none"] for v in VARIANTS},
        "per_rank": reports,
        "threads": "OMP_NUM_THREADS=1, torch.set_num_threads(1)",
    }


def render(data: dict[str, Any]) -> str:
    """The step-time table, as text."""
    cfg, step = data["config"], data["step_seconds"]
    rows = [
        [
            v,
            f"{step[v] * 1e3:.3f}",
            data["step_summary_s"][v].spread(1e3, 3),
            f"{step[v] / step['none']:.3f}",
            f"{step[v] / step['torch_each']:.3f}",
        ]
        for v in VARIANTS
    ]
    title = (
        f"metric sync every step: {cfg['ranks']} ranks (CPU), MLP 128-{cfg['hidden']}-10, batch "
        f"{cfg['batch']}, {2 + 4} metrics, {cfg['steps']} steps x {cfg['repeats']} rounds; "
        "OMP_NUM_THREADS=1 and torch.set_num_threads(1) in every rank"
    )
    headers = ["variant", "step ms", "min-max", "vs none", "vs torch_each"]
    return title + "\n" + format_table(headers, rows)


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """aiodist's aggregator costs the step at most 2% (issue 6)."""
    value = data["ratio_to_none"]["aiodist"]
    where = f"metrics every step, {data['config']['ranks']} ranks"
    return [Goal.judge(where, "step time aiodist/none", "<=", 1.02, value, "issue 6")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600)
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
        timeout=args.timeout,
    )
    print(render(data))
    print(goal_table(goal_list(data)))
    print(f"wrote {write_results('metrics', data)}")


if __name__ == "__main__":
    main()
