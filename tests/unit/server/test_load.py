"""A lighter load than ``benchmarks/bench_load.py``: 200 connections in 10 jobs, repeated.

Real control clients against the in-process server; every wait is bounded,
and after each round the server holds nothing for the jobs that ended.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import anyio

from benchmarks.bench_load import run_round

if TYPE_CHECKING:
    from aiodist import RendezvousServer


def _server_objects() -> int:
    return sum(1 for o in gc.get_objects() if str(type(o).__module__).startswith("aiodist._server"))


async def test_server_holds_200_connections_in_10_jobs_and_forgets_them(
    server: RendezvousServer,
) -> None:
    counts = []
    for i in range(3):
        with anyio.fail_after(30):
            result = await run_round(server.address, 200, 10, prefix=f"load{i}", timeout=20)
            await server.wait_until(lambda s: s.num_connections == 0)
        assert result.held_at_once == 200
        assert sorted(result.counters.values()) == [20] * 10  # every job formed and counted
        assert server.state.jobs == {}
        assert server.state.membership.conns == {}
        server.state.next_deadline()  # drops the timers of finished waits
        assert server.state.out.deadlines == []
        gc.collect()
        counts.append(_server_objects())
    assert server.state.stats.jobs_formed == 30
    assert counts[0] == counts[1] == counts[2], counts  # nothing accumulates per round
