"""Failure isolation and shrink_group with real processes (ranks killed with SIGKILL).

The rendezvous server runs in the test's loop (the ``server`` fixture); each rank
is a subprocess running ``elastic_worker.py``, which prints one JSON report.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from tests.helpers import HELPERS
from tests.helpers.procs import run

if TYPE_CHECKING:
    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow

WORKER = HELPERS / "elastic_worker.py"
HEARTBEAT_TIMEOUT = 2.0  # as in the worker


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the ranks are subprocesses: the test's loop only hosts the server


async def _run_job(server: RendezvousServer, world: int, mode: str) -> dict[int, dict[str, Any]]:
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        argv = [sys.executable, str(WORKER), url, str(rank), str(world), mode]
        result = await run(argv, limit=60)
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
        assert lines, result.stderr[-3000:]
        out: dict[str, Any] = json.loads(lines[-1])
        out["returncode"] = result.returncode
        out["stderr"] = result.stderr[-3000:]
        outs[rank] = out

    with anyio.fail_after(60):  # run_process kills its process when cancelled
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(one, rank)
    return outs


async def test_rank_killed_mid_collective_survivors_shrink_and_go_on(
    server: RendezvousServer,
) -> None:
    outs = await _run_job(server, 4, "shrink")
    victim = outs[2]
    assert victim["returncode"] == -9
    for rank in (0, 1, 3):
        out = outs[rank]
        assert out["returncode"] == 0, out["stderr"]
        kind, failed, message = out["error"]
        assert (kind, failed) == ("RankFailedError", 2), out
        assert "shrink_group" in message
        # Told within the heartbeat timeout of the kill (a dropped connection is seen at once).
        assert out["told_at"] - victim["killed_at"] < HEARTBEAT_TIMEOUT, out
        # Everything that does not need rank 2 went on: the store, p2p, a group without it.
        assert out["store"] == str({0: 1, 1: 3, 3: 0}[rank])
        assert out["world_broken"] == ["RankFailedError", 2]
        # Renumbered as torch renumbers: 0, 1, 3 -> 0, 1, 2; the default group replaced.
        new_rank = {0: 0, 1: 1, 3: 2}[rank]
        assert out["new"] == [new_rank, 3, [0, 1, 3]]
        assert out["default_is_new"] is True
        expected = [float((step + 1) * (1 + 2 + 3)) for step in range(100)]
        assert out["sums"] == expected
        assert out["metrics_ranks"] == 3.0  # aiodist.metrics follows the new default group
    assert outs[0]["pair_sum"] == outs[1]["pair_sum"] == 3.0
    assert outs[3]["p2p"] == {"to": 3}
    assert outs[3]["renumbered_p2p"] == "renumbered"


async def test_second_death_during_shrink_leaves_survivors_in_one_group(
    server: RendezvousServer,
) -> None:
    outs = await _run_job(server, 4, "second")
    assert outs[3]["returncode"] == -9
    assert outs[1]["returncode"] == -9
    survivors = [outs[0], outs[2]]
    for out in survivors:
        assert out["returncode"] == 0, out["stderr"]
        assert out["error"][:2] == ["RankFailedError", 3]
        assert "shrink_error" not in out, out
        assert out["sums"] == [float((step + 1) * (1 + 2)) for step in range(20)]
    # The same group on both: ranks 0 and 2, renumbered 0 and 1.
    assert [out["new"] for out in survivors] == [[0, 2, [0, 2]], [1, 2, [0, 2]]]


async def test_sync_facade_shrinks_and_follows_the_new_default_group(
    server: RendezvousServer,
) -> None:
    outs = await _run_job(server, 3, "sync")
    assert outs[1]["returncode"] == -9
    for rank, new_rank in ((0, 0), (2, 1)):
        out = outs[rank]
        assert out["returncode"] == 0, out["stderr"]
        assert out["error"] == ["RankFailedError", 1]
        assert out["new"] == [new_rank, 2]
        assert out["sum"] == [2.0, 2.0, 2.0]


async def test_an_aggregator_made_before_a_shrink_syncs_among_the_survivors(
    server: RendezvousServer,
) -> None:
    # Before: its every sync after shrink_group went on the old group's shared-memory
    # board and failed with RankFailedError naming the dead rank, for good; only a new
    # MetricAggregator synced on the new default group.
    outs = await _run_job(server, 3, "metrics")
    assert outs[2]["returncode"] == -9
    for rank in (0, 1):
        out = outs[rank]
        assert out["returncode"] == 0, out["stderr"]
        assert out["before"] == [6.0, 6.0, 6.0], out
        assert out["on_board"] is True, out
        assert out["error"] == ["RankFailedError", 2], out
        assert out["after"] == [30.0, 30.0, 30.0], out
