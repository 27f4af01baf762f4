"""The whole fault matrix, cell by cell, into a summary table (``make soak``).

    python -m tests.soak [--seed N] [--only TEXT ...] [--out DIR] [--rounds N]

Every cell of ``tests/helpers/matrix.py`` ({p2p, collectives, store, elastic, rpc} x
{kill9, sigstop, restart, away, newcomer} x {shared memory on, off}) runs in real
processes, one after the other. The table (cell, outcome, time to the failure notice,
values checked, writes checked, first problem) is printed as each cell ends and
written to ``DIR/soak.md`` and ``DIR/soak.json`` (default ``benchmarks/results/``);
each cell's logs (events, stderr, the daemon's output) stay in ``DIR/soak/<cell>/``.
Exit status 1 when a cell failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from tests.helpers import ROOT
from tests.helpers.matrix import HB, cells, run_cell

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tests.helpers.matrix import Outcome

COLUMNS = ("cell", "outcome", "notice (s)", "values", "writes", "time (s)", "first problem")


def row(out: Outcome) -> list[str]:
    notice = "-" if out.notice_s is None else f"{out.notice_s:.2f}"
    first = out.problems[0] if out.problems else ""
    first = first.replace("|", "/").replace("\n", " ")
    if len(first) > 300:
        first = first[:297] + "..."
    return [
        out.cell.name,
        out.result,
        notice,
        str(out.values),
        str(out.writes),
        f"{out.seconds:.0f}",
        first,
    ]


def markdown(outs: list[Outcome], seed: int, rounds: int, took: float) -> str:
    passed = sum(o.ok for o in outs)
    lines = [
        "# Fault matrix",
        "",
        f"Seed {seed}; {rounds} rounds before and after each fault; heartbeat timeout {HB} s "
        f"(a notice is due within {2 * HB} s); "
        f"{len(outs)} cells, {passed} passed, {len(outs) - passed} failed; {took / 60:.1f} min.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(row(o)) + " |" for o in outs]
    failed = [o for o in outs if not o.ok]
    if failed:
        lines += ["", "## Problems", ""]
        for o in failed:
            lines.append(f"### {o.cell.name} (victim: rank {o.cell.victim}; logs {o.logs})")
            lines.append("")
            lines += [f"- {p}".replace("\n", "\n  ") for p in o.problems]
            lines.append("")
    return "\n".join(lines) + "\n"


async def soak(seed: int, only: Sequence[str], out_dir: Path, rounds: int) -> int:
    chosen = [c for c in cells(seed) if not only or any(o in c.name for o in only)]
    logs = out_dir / "soak"
    shutil.rmtree(logs, ignore_errors=True)
    outs: list[Outcome] = []
    started = time.monotonic()
    print(" | ".join(COLUMNS[:-1]), flush=True)
    for cell in chosen:
        out = await run_cell(cell, logs / cell.name.replace("/", "-"), rounds)
        outs.append(out)
        print(" | ".join(row(out)), flush=True)
        took = time.monotonic() - started
        (out_dir / "soak.md").write_text(markdown(outs, seed, rounds, took))
        summary = {"seed": seed, "rounds": rounds, "hb": HB, "cells": [o.as_dict() for o in outs]}
        (out_dir / "soak.json").write_text(json.dumps(summary, indent=1))
    passed = sum(o.ok for o in outs)
    print(f"{passed} of {len(outs)} cells passed; table in {out_dir / 'soak.md'}", flush=True)
    return 0 if passed == len(outs) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=[], help="cells whose name holds TEXT")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--rounds", type=int, default=10, help="rounds each rank runs before and after a fault"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return anyio.run(soak, args.seed, args.only, args.out, args.rounds)


if __name__ == "__main__":
    sys.exit(main())
