"""Scripts written for torch and mmengine, unchanged: torch's default group, mmengine's seed.

``init_process_group()`` with no backend brings up torch's default group, as torch does,
on the ``aiodist`` backend: torch's calls ride aiodist's data plane.

Plain torch training code (DDP, ``DistributedSampler``) on ``aiodist.sync``,
under ``aiodist run`` as real processes, with the defaults users get.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import pytest

from tests.helpers import HELPERS, ROOT
from tests.helpers import procs as _procs

pytestmark = pytest.mark.slow

WORKER = str(HELPERS / "newuser_worker.py")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _reports(stdout: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for line in stdout.splitlines():
        _, _, payload = line.rpartition("] ")
        with contextlib.suppress(json.JSONDecodeError):
            report = json.loads(payload)
            out.setdefault(report["rank"], {}).update(report)
    return out


async def _run(torch_group: str | None) -> dict[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env["PYTHONPATH"] = str(ROOT)
    if torch_group is not None:
        env["AIODIST_TORCH_GROUP"] = torch_group
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    argv += [sys.executable, "-m", "aiodist", "run", "-n", "2", WORKER, "ddp"]
    result = await _procs.run(argv, 60.0)
    assert result.returncode == 0, result.stderr
    return _reports(result.stdout)


async def test_no_backend_brings_up_torch_default_group_for_ddp_and_sampler() -> None:
    reports = await _run(None)
    # Before: torch.distributed was not initialised; DDP raised "Default process group
    # has not been initialized".
    for rank in (0, 1):
        r = reports[rank]
        assert r["torch_initialized"] is True, r
        assert r["torch_backend"] == "aiodist", r  # no CUDA here: aiodist alone
        assert r["grad"] == [[1.5, 1.5]], r  # (1 + 2) / 2: DDP averaged over the ranks
        assert r["all_reduce"] == [2.0, 2.0], r
        assert r["torch_after_destroy"] is False, r
    assert reports[0]["indices"] == [0, 2, 4]
    assert reports[1]["indices"] == [1, 3, 5]


async def test_torch_group_off_leaves_torch_distributed_alone() -> None:
    reports = await _run("0")
    for rank in (0, 1):
        assert reports[rank]["torch_initialized"] is False, reports[rank]
        assert reports[rank]["all_reduce"] == [2.0, 2.0], reports[rank]


async def test_sync_random_seed_comes_through_torch_tensor_as_mmengine_tests_expect() -> None:
    # mmengine's tests/test_dist/test_dist.py::test_sync_random_seed, on two ranks.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env.update(PYTHONPATH=str(ROOT))
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    argv += [sys.executable, "-m", "aiodist", "run", "-n", "2", WORKER, "seed"]
    result = await _procs.run(argv, 60.0)
    assert result.returncode == 0, result.stderr
    reports = _reports(result.stdout)
    # Before: the seed was drawn and broadcast as an int, never through torch.tensor.
    assert [(reports[r]["seed"], reports[r]["called"]) for r in (0, 1)] == [(1024, True)] * 2


@pytest.mark.parametrize(("mode", "field"), [("gloo_extra", "op"), ("gloo_shape", "shape")])
async def test_gloo_calls_that_disagree_fail_cleanly_on_every_rank_with_the_check_on(
    mode: str, field: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env.update(PYTHONPATH=str(ROOT), AIODIST_CHECK_SIGNATURES="1")
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    argv += [sys.executable, "-m", "aiodist", "run", "-n", "2", WORKER, mode]
    result = await _procs.run(argv, 60.0)
    reports = _reports(result.stdout)
    # Before: the extra all_reduce hung until the timeout; with shapes [2] and [3],
    # rank 0 returned a wrong result and rank 1 saw gloo's "Connection closed by peer".
    for rank in (0, 1):
        r = reports[rank]
        assert r.get("error") == "CollectiveMismatchError", r
        assert r["field"] == field, r
        assert r["after"] < 5.0, r


@pytest.mark.parametrize(("mode", "field"), [("torch_extra", "op"), ("torch_shape", "shape")])
async def test_torch_calls_that_disagree_fail_cleanly_on_every_rank_with_no_setting(
    mode: str, field: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env.update(PYTHONPATH=str(ROOT))
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    argv += [sys.executable, "-m", "aiodist", "run", "-n", "2", WORKER, mode]
    result = await _procs.run(argv, 60.0)
    reports = _reports(result.stdout)
    # torch's own calls on the aiodist backend are aiodist's: on gloo, the extra
    # all_reduce hung until the timeout, and shapes [2] and [3] gave rank 0 a wrong
    # result while rank 1 saw "Connection closed by peer".
    for rank in (0, 1):
        r = reports[rank]
        assert r.get("error") == "CollectiveMismatchError", r
        assert r["field"] == field, r
        assert r["after"] < 5.0, r
