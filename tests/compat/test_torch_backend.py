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
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LIMIT = 90.0  # for one launch: the backstop, never the expected time


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the loop only waits for the processes


async def _train(launcher: list[str], init: str, world: int = 2) -> dict[int, dict[str, Any]]:
    argv = [*launcher, "--nproc-per-node", str(world), WORKER, init]
    env = {"PYTHONPATH": str(ROOT)}
    result = await _procs.run(argv, LIMIT, env)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = _procs.reports_by_rank(result.stdout)
    assert sorted(reports) == list(range(world)), result.stdout
    return reports


async def test_ddp_on_the_aiodist_backend_trains_as_on_gloo_under_torchrun() -> None:
    runs: dict[str, dict[int, dict[str, Any]]] = {}

    async def one(init: str) -> None:
        runs[init] = await _train(TORCHRUN, init)

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
