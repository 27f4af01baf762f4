"""What the always-on flight recorder costs: small calls with and without it, in one run.

Two ranks (``aiodist run -n 2 benchmarks/_recorder_ranks.py``) time a 4-byte
all_reduce and an 8-byte point-to-point round trip in alternating pairs of
blocks, recorder on, off, off, on (A B B A), so that the machine's drift
falls on both sides alike. Each pair gives one ratio, the time per call with
the recorder over the time without it; the cost is that ratio minus one, as
a median with its spread (min-max) over the pairs. Goal (issue 32): at most
2 %. On a busy machine the spread can dwarf the cost; ``derived`` is the
noise-free figure beside it: the recorder's own time per operation, measured
in one process, times the operations one rank records per call, over the
time per call without it.

Usage::

    python -m benchmarks.bench_recorder [--pairs 25] [--iters 800]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from benchmarks._common import Goal, format_table, summarize

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["GOAL", "bench", "costs", "goal_list", "render"]

GOAL: Final = 0.02  # the most the recorder may add to a small call's time
SOURCE: Final = "issue 32"
RANKS: Final = Path(__file__).with_name("_recorder_ranks.py")
# Operations one rank records per call: a round trip is an isend and an irecv on each rank.
OPS_PER_CALL: Final = {"all_reduce 4 B": 1, "p2p_round_trip 8 B": 2}


def bench(pairs: int, iters: int, timeout: float = 600.0) -> dict[str, Any]:
    """Run the two ranks; return every block's time and each case's cost."""
    env = {k: v for k, v in os.environ.items() if k != "AIODIST_RECORDER_SIZE"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "blocks.json"
        cmd = [sys.executable, "-m", "aiodist", "run", "-n", "2", str(RANKS)]
        subprocess.run(
            [*cmd, str(out), str(pairs), str(iters)],
            check=True,
            timeout=timeout,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        data: dict[str, Any] = json.loads(out.read_text())
    data["costs"] = {case: costs(blocks) for case, blocks in data["blocks"].items()}
    own = data["record_ns"] = record_ns()
    for case, c in data["costs"].items():
        # Noise-free: the recorder's own time for the operations one rank records per call.
        c["derived"] = own["median"] * OPS_PER_CALL[case] / (c["off_us"] * 1e3)
    return data


def record_ns(calls: int = 20000, pairs: int = 5) -> dict[str, float]:
    """The recorder's own time per operation, in one process: record + settle, minus settle.

    Recording includes what the calls pay for it besides ``record``: a clock
    reading and the tensor's dtype and shape.

    A B B A over ``pairs``: handles settled with the recorder listening, and
    without. Less noisy than the ranks' blocks (no sockets, no other process).
    """
    import asyncio

    import torch

    from aiodist._group.recorder import Recorder
    from aiodist._group.work import Work

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        rec, t = Recorder(0, "bench"), torch.ones(1)
        out = []
        for _ in range(pairs):
            times = {"on": 0.0, "off": 0.0}
            for mode in ("on", "off", "off", "on"):
                works: list[Work[None]] = [Work.pending(loop, "all_reduce#1") for _ in range(calls)]
                start = time.perf_counter_ns()
                if mode == "on":
                    for w in works:
                        # What a call pays for it: its clock, the tensor's dtype and shape.
                        called = time.perf_counter_ns()
                        rec.record(w, "all_reduce", "g", 1, -1, t.dtype, t.shape, called)
                        w.set_result(None)
                else:
                    for w in works:
                        w.set_result(None)
                times[mode] += time.perf_counter_ns() - start
            out.append((times["on"] - times["off"]) / (2 * calls))
        return out

    samples = asyncio.run(run())
    s = summarize(samples)
    assert s is not None
    return {"median": s.median, "min": s.min, "max": s.max}


def costs(blocks: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Per A B B A quadruple: (on + on) / (off + off) - 1; with the times per call."""
    ratios, on, off = [], [], []
    for i in range(0, len(blocks) - 3, 4):
        quad = blocks[i : i + 4]
        t_on = sum(t for mode, t in quad if mode == "on")
        t_off = sum(t for mode, t in quad if mode == "off")
        ratios.append(t_on / t_off - 1.0)
        on.append(t_on / 2)
        off.append(t_off / 2)
    cost, t_on, t_off = summarize(ratios), summarize(on), summarize(off)
    return {
        "cost_median": None if cost is None else cost.median,
        "cost_min": None if cost is None else cost.min,
        "cost_max": None if cost is None else cost.max,
        "on_us": None if t_on is None else t_on.median * 1e6,
        "off_us": None if t_off is None else t_off.median * 1e6,
        "pairs": len(ratios),
    }


def render(data: dict[str, Any]) -> str:
    """The cost table: time per call on and off (medians), the cost and its spread."""
    rows = []
    for case, c in data["costs"].items():
        rows.append(
            [
                case,
                f"{c['on_us']:.1f}",
                f"{c['off_us']:.1f}",
                f"{100 * c['cost_median']:+.2f} %",
                f"{100 * c['cost_min']:+.2f} .. {100 * c['cost_max']:+.2f} %",
                f"{100 * c['derived']:.2f} %",
                c["pairs"],
            ]
        )
    title = f"flight recorder cost, 2 ranks, {data['iters']} calls per block, A B B A pairs"
    headers = ["case", "on us/call", "off us/call", "cost (median)", "spread", "derived", "pairs"]
    own = data.get("record_ns")
    note = ""
    if own is not None:
        note = (
            f"\nthe recorder's own time per operation (one process, A B B A): "
            f"{own['median']:.0f} ns ({own['min']:.0f}-{own['max']:.0f})"
        )
    return f"{title}\n{format_table(headers, rows)}{note}"


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """The recorder's cost against the 2 % goal, per case (median over the pairs)."""
    return [
        Goal.judge(
            f"recorder cost, {case}", "time on/off - 1", "<=", GOAL, c["cost_median"], SOURCE
        )
        for case, c in data["costs"].items()
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.bench_recorder``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_recorder")
    parser.add_argument("--pairs", type=int, default=25)
    parser.add_argument("--iters", type=int, default=800)
    args = parser.parse_args(argv)
    data = bench(args.pairs, args.iters)
    print(render(data))


if __name__ == "__main__":
    main()
