"""The process-heavy tests, round after round, on a loaded machine (``make test-stress``).

    python -m tests.stress [--rounds N] [--workers N] [--burners N] [PYTEST_ARGS ...]

Each round runs the tests that start processes of their own (``tests/integration``,
``tests/compat``) in parallel, as ``make test`` does, while burner processes keep
every core busy: what a quiet machine hides (a wait sized for its speed, an order
that only a slow process shows) fails here. Every failure of every round is
reported, with the round it came in (and pytest's whole output of that round kept in
``$TMPDIR/aiodist-stress``); nothing is run again. Exit status 1 when any
test failed in any round. A flaky mark may only ever come back after this passes
clean.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tests.helpers import ROOT

PROCESS_HEAVY = ("tests/integration", "tests/compat")
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
# Where a round with failures leaves pytest's whole output.
LOGS = Path(tempfile.gettempdir()) / "aiodist-stress"


def burn() -> None:  # pragma: no cover - runs in a burner process
    os.nice(5)  # loaded, not starved: the suite still gets most of each core
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers (default auto)")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    args, rest = parser.parse_known_args(argv)
    targets = [a for a in rest if not a.startswith("-")] or list(PROCESS_HEAVY)
    options = [a for a in rest if a.startswith("-")]
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    failures: dict[str, list[int]] = defaultdict(list)
    try:
        for n in range(1, args.rounds + 1):
            started = time.monotonic()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["-n", args.workers, *options, *targets]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            failed = _FAILED.findall(done.stdout)
            if done.returncode not in (0, 1) or (done.returncode == 1 and not failed):
                failed = failed or [f"pytest exited with {done.returncode}"]
                sys.stdout.write(done.stdout[-4000:] + done.stderr[-4000:])
            for test in failed:
                failures[test].append(n)
            tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
            took = time.monotonic() - started
            print(f"round {n}/{args.rounds}: {took:.0f} s, {tail[0]}", flush=True)
            for test in failed:
                print(f"    failed: {test}", flush=True)
            if failed:  # what each failure said, kept for finding its cause
                log = LOGS / f"round-{n}.log"
                LOGS.mkdir(parents=True, exist_ok=True)
                log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
                print(f"    pytest's output: {log}", flush=True)
    finally:
        for b in burners:
            b.kill()
    print()
    if not failures:
        print(f"{args.rounds} rounds under {args.burners} burners: 0 failures")
        return 0
    print(f"{args.rounds} rounds under {args.burners} burners: {len(failures)} tests failed")
    for test, rounds in sorted(failures.items()):
        print(f"  {test}: rounds {', '.join(map(str, rounds))}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
