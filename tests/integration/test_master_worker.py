"""Master-worker mode with real processes: a master (rank 0) and two workers, one job each.

Each job is ``tests/helpers/master_worker_worker.py`` at world size 3, rank 0
hosting the server (``procs.run_job``); the master checks every result against
the same operations done locally and reports each check by name.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import Finished, reports_by_rank, run_job

pytestmark = pytest.mark.anyio
WORKER = str(ROOT / "tests" / "helpers" / "master_worker_worker.py")


async def _job(case: str) -> tuple[dict[int, dict[str, Any]], list[Finished]]:
    ranks = await run_job([sys.executable, WORKER, case], 3, limit=90)
    reports: dict[int, dict[str, Any]] = {}
    for finished in ranks:
        reports.update(reports_by_rank(finished.stdout))
    assert 0 in reports, "the master reported nothing:\n" + ranks[0].stderr[-3000:]
    return reports, ranks


def _failed(checks: dict[str, str]) -> dict[str, str]:
    return {name: what for name, what in checks.items() if what != "ok"}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the ranks run their own loops
async def test_every_operation_kind_on_remote_tensors_matches_torch_run_locally() -> None:
    # Made there and sent there; operators, functions, methods, properties, several
    # results, in place, indexing, a shape known only from the values, operands on two
    # workers; order within a stream, events on one worker and across two; an error at
    # the sync points that meet it; a worker frees what the master dropped.
    reports, ranks = await _job("operations")
    checks = reports[0]["checks"]
    assert len(checks) >= 27, checks
    assert not _failed(checks), _failed(checks)
    for rank in (1, 2):  # each worker served until the master left, then left itself
        assert ranks[rank].returncode == 0, ranks[rank].stderr[-3000:]
        assert reports[rank]["returned"] is False


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_worker_that_dies_fails_what_it_held_and_the_master_goes_on() -> None:
    reports, ranks = await _job("killed")
    checks = reports[0]["checks"]
    assert set(checks) == {
        "before",
        "pending on the dead worker",
        "held by the dead worker",
        "the others go on",
        "new on the dead worker",
    }
    assert not _failed(checks), _failed(checks)
    assert ranks[0].returncode == 0, ranks[0].stderr[-3000:]
    assert ranks[2].returncode == 9  # os._exit(9), run on it as an operation
    assert ranks[1].returncode == 0
    assert reports[1]["returned"] is False


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_plain_code_blocks_at_the_sync_points() -> None:
    reports, ranks = await _job("plain")
    checks = reports[0]["checks"]
    assert set(checks) == {"plain fetch", "plain moved", "plain sync points"}
    assert not _failed(checks), _failed(checks)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
