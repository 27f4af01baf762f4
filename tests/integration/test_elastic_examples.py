"""examples/elastic_train.py: training goes on and converges after a rank leaves or is killed."""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

import anyio
import pytest

from tests.helpers import ROOT
from tests.helpers.procs import run

if TYPE_CHECKING:
    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "elastic_train.py"
PIPELINE = EXAMPLES / "elastic_pipeline.py"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the ranks are subprocesses: the test's loop only hosts the server


def _summary(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if "elastic train:" in line)


async def test_elastic_train_under_aiodist_run_goes_on_after_a_rank_leaves() -> None:
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "4", str(SCRIPT), "--steps", "80"]
    result = await run(argv, limit=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] event: step 40: rank 3 gone, shrank to 3 ranks" in result.stdout
    assert "world 4 -> 3" in _summary(result.stdout)
    assert "<- a rank failed here" in result.stdout


async def _run_ranks(server: RendezvousServer, argv: list[str]) -> dict[int, tuple[int, str, str]]:
    """Run ``argv`` as 4 ranks that meet at ``server`` (env://); each one's code and output."""
    host, port = server.address
    outs: dict[int, tuple[int, str, str]] = {}

    async def one(rank: int) -> None:
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "4",
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
            "AIODIST_HEARTBEAT_TIMEOUT": "2",
        }
        result = await anyio.run_process([sys.executable, *argv], check=False, env=env)
        outs[rank] = (result.returncode, result.stdout.decode(), result.stderr.decode())

    with anyio.fail_after(60):  # run_process kills its process when cancelled
        async with anyio.create_task_group() as tg:
            for rank in range(4):
                tg.start_soon(one, rank)
    return outs


async def test_elastic_train_goes_on_after_a_rank_is_killed_mid_step(
    server: RendezvousServer,
) -> None:
    argv = [str(SCRIPT), "--kill", "--steps", "60", "--fail-at", "20"]
    outs = await _run_ranks(server, argv)
    assert outs[3][0] == -9
    for rank in (0, 1, 2):
        assert outs[rank][0] == 0, outs[rank][2][-3000:]
    stdout = outs[0][1]
    # Step 20's all_reduce was in flight: rank 0 may have completed it (it had rank 3's part).
    assert re.search(r"event: step 2[01]: rank 3 gone, shrank to 3 ranks", stdout), stdout
    assert "world 4 -> 3" in _summary(stdout)  # and it converged: the script asserts it


# Timed out in 2 of 5 full runs on two workers, never alone: run again once, until the
# cause is found.
@pytest.mark.flaky(reruns=1)
async def test_elastic_pipeline_processes_every_item_once_when_workers_leave() -> None:
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "4", str(PIPELINE), "--items", "200"]
    result = await run(argv, limit=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] elastic pipeline: 200 of 200 items, each processed exactly once; " in (
        result.stdout
    )
    assert "workers gone: [2, 3]" in result.stdout


async def test_elastic_pipeline_processes_every_item_once_when_workers_are_killed(
    server: RendezvousServer,
) -> None:
    outs = await _run_ranks(server, [str(PIPELINE), "--kill", "--items", "200"])
    assert [outs[r][0] for r in range(4)] == [0, 0, -9, -9], [o[2][-2000:] for o in outs.values()]
    line = next(x for x in outs[0][1].splitlines() if "elastic pipeline:" in x)
    assert line.startswith("elastic pipeline: 200 of 200 items, each processed exactly once; ")
    assert "workers gone: [2, 3]" in line
