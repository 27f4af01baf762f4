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
DDP = EXAMPLES / "elastic_ddp.py"


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


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param("", id="aiodist-plane"),
        # gloo standing in for NCCL: torch's calls on CPU tensors go to a device part, built
        # again over each membership (the path CUDA tensors take on NCCL).
        pytest.param("cpu:gloo", id="gloo-part"),
    ],
)
async def test_elastic_ddp_goes_on_after_a_kill_in_backward_and_takes_in_a_replacement(
    parts: str,
) -> None:
    # Plain torch DDP on the default group: before, its gradients went through gloo, and a
    # dead rank aborted (SIGABRT) or hung gloo; nothing shrank and no replacement joined.
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "4", "--replace-failed", str(DDP)]
    argv += ["--steps", "40", "--kill-at", "15", "--after", "5"]
    result = await run(argv, limit=120, env={"AIODIST_TORCH_PARTS": parts} if parts else None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    both = out + result.stderr[-3000:]  # the launcher says there how each rank ended
    assert "[rank 0] event: step 15: rank 3 killed, 3 ranks go on" in out, both
    joined = re.search(r"\[rank 0\] event: step (\d+): rank 4 joined, 4 ranks again", out)
    assert joined is not None, both
    summary = next(line for line in out.splitlines() if "elastic ddp:" in line)
    # It trained on to step 40 at least, and 5 steps as four again: the loss fell (the
    # script asserts it) and the replacement took part in the last steps.
    steps = int(summary.split("elastic ddp: ")[1].split(" steps")[0])
    assert steps >= max(40, int(joined.group(1)) + 5), summary
    assert summary.endswith("world 4 -> 4"), summary
    # The replacement may join at the step of the kill: then one mark names both.
    assert re.search(r"<- a rank was killed here", out), out
    assert re.search(r"<- (.*, )?a rank joined here", out), out
    assert "was killed by SIGKILL; starting a replacement" in result.stderr


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
        result = await run([sys.executable, *argv], 60, env=env)  # says what it printed
        outs[rank] = (result.returncode, result.stdout, result.stderr)

    with anyio.fail_after(90):
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


async def test_elastic_pipeline_processes_every_item_once_when_workers_leave() -> None:
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "4", str(PIPELINE), "--items", "400"]
    result = await run(argv, limit=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] elastic pipeline: 400 of 400 items, each processed exactly once; " in (
        result.stdout
    )
    assert "workers gone: [2, 3]" in result.stdout


async def test_elastic_pipeline_processes_every_item_once_when_workers_are_killed(
    server: RendezvousServer,
) -> None:
    outs = await _run_ranks(server, [str(PIPELINE), "--kill", "--items", "400"])
    assert [outs[r][0] for r in range(4)] == [0, 0, -9, -9], [o[2][-2000:] for o in outs.values()]
    line = next(x for x in outs[0][1].splitlines() if "elastic pipeline:" in x)
    assert line.startswith("elastic pipeline: 400 of 400 items, each processed exactly once; ")
    # As docs/guide/elastic.md shows it (before: a "joined: []" the page does not show).
    assert "workers gone: [2, 3]; items per worker: {" in line, line
