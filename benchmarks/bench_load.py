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
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import anyio
import uvloop

from aiodist._control.connection import connect_control
from aiodist._wire.messages import (
    Barrier,
    Join,
    Leave,
    StoreAdd,
    StoreSet,
    StoreWait,
    pack_keys,
)
from benchmarks._common import Goal, format_table, goal_table, raise_fd_limit, write_results

__all__ = ["LoadRound", "bench", "goal_list", "render", "run_round"]


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
        keys = pack_keys([f"k{i}" for i in range(world_size)])
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


async def _rounds(
    address: tuple[str, int], pid: int, connections: int, jobs: int, rounds: int
) -> dict[str, Any]:
    baseline, _ = _rss_kib(pid)
    results = []
    for i in range(rounds):
        r = await run_round(address, connections, jobs, prefix=f"load{i}")
        rss, peak = _rss_kib(pid)
        results.append(
            {**asdict(r), "jobs_formed": len(r.counters), "rss_kib": rss, "peak_kib": peak}
        )
    return {"baseline_kib": baseline, "rounds": results}


def bench(connections: int, jobs: int, rounds: int) -> dict[str, Any]:
    """Run ``rounds`` rounds against a fresh ``aiodist serve``; return plain data."""
    raise_fd_limit(connections * 2 + 256)  # the server inherits it
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
        data: dict[str, Any] = anyio.run(
            _rounds,
            ("127.0.0.1", port),
            daemon.pid,
            connections,
            jobs,
            rounds,
            backend_options=options,
        )
    finally:
        daemon.terminate()
        daemon.wait(10)
    data["config"] = {"connections": connections, "jobs": jobs, "rounds": rounds}
    return data


def render(data: dict[str, Any]) -> str:
    """The per-round table, as text."""
    rows = [
        [
            i,
            r["held_at_once"],
            r["jobs_formed"],
            f"{r['seconds']:.2f}",
            f"{r['peak_kib'] / 1024:.1f}",
            f"{r['rss_kib'] / 1024:.1f}",
        ]
        for i, r in enumerate(data["rounds"])
    ]
    headers = ["round", "connections held", "jobs formed", "time s", "peak MiB", "after MiB"]
    return f"server baseline {data['baseline_kib'] / 1024:.1f} MiB\n" + format_table(headers, rows)


# Server memory may grow by this much from the end of the first round to the end of the last
# (allocator arenas settle in the first round; a per-round leak shows as steady growth).
MEMORY_GROWTH_LIMIT_MIB: Final = 8.0


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """Every member held at once and every job formed each round; server memory steady."""
    cfg, rounds = data["config"], data["rounds"]
    held = min((r["held_at_once"] / cfg["connections"] for r in rounds), default=None)
    formed = min((r["jobs_formed"] / cfg["jobs"] for r in rounds), default=None)
    growth = (rounds[-1]["rss_kib"] - rounds[0]["rss_kib"]) / 1024 if rounds else None
    where = f"{cfg['connections']} connections / {cfg['jobs']} jobs"
    return [
        Goal.judge(f"load {where}", "share held at once", ">=", 1.0, held, "issue 8"),
        Goal.judge(f"load {where}", "share of jobs formed", ">=", 1.0, formed, "issue 8"),
        Goal.judge(
            f"load {where}, {len(rounds)} rounds",
            "server RSS growth after round 1 (MiB)",
            "<=",
            MEMORY_GROWTH_LIMIT_MIB,
            growth,
            "issue 8",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    data = bench(args.connections, args.jobs, args.rounds)
    print(render(data))
    print(goal_table(goal_list(data)))
    print(f"results: {write_results('load', data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
