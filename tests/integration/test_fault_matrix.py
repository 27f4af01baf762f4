"""A selection of the fault matrix (``tests/helpers/matrix.py``; ``make soak`` runs it all).

Each cell runs a daemon with a state directory and a job of real processes under a
real fault (SIGKILL, SIGSTOP, the daemon killed and started again, a newcomer), and
checks every value, every acknowledged write, every survivor's notice of the failure
(``RankFailedError`` naming the victim within twice the heartbeat timeout), and that
nothing hangs. The selection is fixed (seed 0): four cells, about 35 s on two cores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.helpers.daemon import asyncio_only
from tests.helpers.matrix import Cell, Outcome, run_cell

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SELECTION = [
    Cell("collectives", "kill9", shm=True),
    Cell("store", "restart", shm=False),
    Cell("p2p", "sigstop", shm=False),
    Cell("rpc", "kill9", shm=True),
]


def _param(cell: Cell) -> object:
    return pytest.param(cell, id=cell.name)


def _report(out: Outcome) -> str:
    lines = [f"{out.cell.name} (victim {out.cell.victim}; logs in {out.logs}):"]
    return "\n".join(lines + [f"- {p}" for p in out.problems])


@asyncio_only
@pytest.mark.parametrize("cell", [_param(c) for c in SELECTION])
async def test_fault_matrix_cell_keeps_every_value_and_write_and_names_the_failure(
    tmp_path: Path, cell: Cell
) -> None:
    out = await run_cell(cell, tmp_path)
    assert out.ok, _report(out)
    assert out.values > 0
    if cell.workload == "store":
        assert out.writes > 0
    if cell.victim is not None:
        assert out.notice_s is not None
