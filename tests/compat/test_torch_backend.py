"""torch's own code on the aiodist backend: DDP, DistributedSampler, communication hooks.

A plain torch DDP script (``tests/helpers/ddp_worker.py``) runs as users run it,
under torchrun and ``aiodist run``, with ``backend="gloo"``, ``backend="aiodist"``
and aiodist's ``init_process_group()`` with no backend (torch's default group on
aiodist). The parameters after training must be gloo's, bit for bit (two ranks:
a sum of two is the same in any order), and the sampler's indices the same.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
import pytest

from tests.helpers import HELPERS, ROOT
from tests.helpers import procs as _procs

pytestmark = pytest.mark.slow

WORKER = str(HELPERS / "ddp_worker.py")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
    # Before: a script's own init_process_group(backend="gloo") failed under it with
    # EADDRINUSE (aiodist's server held MASTER_PORT, where torch's TCPStore listens).
    "aiodist-run": [sys.executable, "-m", "aiodist", "run"],
}
LIMIT = 90.0  # for one launch: the backstop, never the expected time


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the loop only waits for the processes


async def _train(launcher: list[str], init: str, world: int = 2) -> dict[int, dict[str, Any]]:
    argv = [*launcher, "--nproc-per-node", str(world), WORKER, init]
    env = {"PYTHONPATH": str(ROOT)}
    result = await _procs.run(argv, LIMIT, env)
    assert result.returncode == 0, result.stderr[-3000:]
    # aiodist run prefixes each line with "[rank N] ".
    lines = [
        line.partition("] ")[2] if line.startswith("[rank") else line
        for line in result.stdout.splitlines()
    ]
    reports = _procs.reports_by_rank("\n".join(lines))
    assert sorted(reports) == list(range(world)), result.stdout
    return reports


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
async def test_ddp_on_the_aiodist_backend_trains_as_on_gloo(launcher: str) -> None:
    runs: dict[str, dict[int, dict[str, Any]]] = {}

    async def one(init: str) -> None:
        runs[init] = await _train(LAUNCHERS[launcher], init)

    with anyio.fail_after(3 * LIMIT):
        async with anyio.create_task_group() as tg:
            for init in ("gloo", "aiodist", "default"):
                tg.start_soon(one, init)
    gloo = runs["gloo"]
    for init in ("aiodist", "default"):
        for rank, report in runs[init].items():
            assert report["backend"] == "aiodist"
            assert report["indices"] == gloo[rank]["indices"]  # DistributedSampler
            assert report["losses"] == gloo[rank]["losses"]
            assert report["params"] == gloo[rank]["params"], (init, rank)
            assert report["hooked"] == gloo[rank]["hooked"] > 0  # the hook's futures ran
    assert gloo[0]["params"] == gloo[1]["params"]  # DDP kept the replicas equal
