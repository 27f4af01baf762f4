"""Load on one rendezvous server: thousands of control connections across many jobs.

Every member is a real control client (``connect_control``, the one ranks
use) on one uvloop loop. Per round, each member connects, joins its job,
sets a key, adds to a counter, waits for its job's keys, passes the job's
server-side barrier, and then holds its connection until *every* member of
every job got that far (so the server holds all connections at once), then
leaves. Rounds repeat with fresh job names; the server's resident memory is
read after each round, to see it return to its level before the first.

The server is ``aiodist serve`` in its own process, so its memory is its own.

Usage::

    python -m benchmarks.bench_load [--connections 2000] [--jobs 100] [--rounds 3]

Results go to ``benchmarks/results/load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvloop

from aiodist._control import connect_control
from aiodist._wire.messages import Barrier, Join, Leave, StoreAdd, StoreSet, StoreWait
from benchmarks._common import format_table, raise_fd_limit, write_results

__all__ = ["LoadRound", "run_round"]


@dataclass
class LoadRound:
    """What one round did: connections held at once, jobs formed, its duration."""

    connections: int = 0
    held_at_once: int = 0
    jobs: int = 0
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


async def _member(
    address: tuple[str, int],
    job: str,
    world_size: int,
    timeout: float,
    all_in: anyio.Event,
    arrived: list[int],
    total: int,
    out: LoadRound,
) -> None:
    conn = await connect_control(*address, timeout=timeout)
    try:
        welcome: Any = await conn.request(
            lambda r: Join(r, job, world_size, -1, "load", os.getpid(), [], 60.0, timeout),
            timeout=timeout,
        )
        rank = welcome.rank
        await conn.request(lambda r: StoreSet(r, f"k{rank}", b"x" * 32), timeout=timeout)
        count = await conn.request(lambda r: StoreAdd(r, "count", 1), timeout=timeout)
        keys = [f"k{i}" for i in range(world_size)]
        await conn.request(lambda r: StoreWait(r, keys, timeout), timeout=timeout)
        await conn.request(lambda r: Barrier(r, 0, timeout), timeout=timeout)
        if count == world_size:
            out.counters[job] = count
        arrived[0] += 1
        if arrived[0] == total:
            out.held_at_once = total
            all_in.set()
        with anyio.fail_after(timeout):
            await all_in.wait()
        await conn.request(Leave, timeout=timeout)
    finally:
        conn.close()


async def run_round(
    address: tuple[str, int], connections: int, jobs: int, *, prefix: str, timeout: float = 60.0
) -> LoadRound:
    """One round of ``connections`` members spread over ``jobs`` jobs; every await is bounded.

    Raises:
        TimeoutError: A member waited longer than ``timeout`` for anything.
    """
    if connections % jobs:
        raise ValueError(f"connections ({connections}) must be a multiple of jobs ({jobs})")
    per_job = connections // jobs
    out = LoadRound(connections=connections, jobs=jobs)
    all_in = anyio.Event()
    arrived = [0]
    started = time.perf_counter()
    with anyio.fail_after(timeout * 2):
        async with anyio.create_task_group() as tg:
            for j in range(jobs):
                for _ in range(per_job):
                    tg.start_soon(
                        _member,
                        address,
                        f"{prefix}-{j}",
                        per_job,
                        timeout,
                        all_in,
                        arrived,
                        connections,
                        out,
                    )
    out.seconds = time.perf_counter() - started
    return out


def _rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB: its memory now, and its peak."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


async def _rounds(args: argparse.Namespace, address: tuple[str, int], pid: int) -> None:
    baseline, _ = _rss_kib(pid)
    rows, results = [], []
    for i in range(args.rounds):
        r = await run_round(address, args.connections, args.jobs, prefix=f"load{i}")
        rss, peak = _rss_kib(pid)
        shown = [f"{r.seconds:.2f}", f"{peak / 1024:.1f}", f"{rss / 1024:.1f}"]
        rows.append([i, r.held_at_once, len(r.counters), *shown])
        results.append({**r.__dict__, "rss_kib": rss, "peak_kib": peak})
    headers = ["round", "connections held", "jobs formed", "time s", "peak MiB", "after MiB"]
    print(f"server baseline {baseline / 1024:.1f} MiB (pid {pid})")
    print(format_table(headers, rows))
    write_results("load", {"baseline_kib": baseline, "rounds": results})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    raise_fd_limit(args.connections * 2 + 256)  # the server inherits it
    env = {**os.environ, "AIODIST_LOG_LEVEL": "warning"}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "aiodist", "serve", "--port", "0", "--log-format", "json"],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert daemon.stdout is not None
        port = int(json.loads(daemon.stdout.readline())["port"])
        options = {"loop_factory": uvloop.new_event_loop}
        anyio.run(_rounds, args, ("127.0.0.1", port), daemon.pid, backend_options=options)
    finally:
        daemon.terminate()
        daemon.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
