"""Membership views (sans-IO) and the launcher's elastic environment (no processes)."""

from __future__ import annotations

import anyio
import pytest

from aiodist._group.views import MAX_VIEWS, MembershipView, Views
from aiodist._launch.cli import main as cli_main
from aiodist._launch.run import LaunchSpec, rank_env


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_views_count_joins_failures_and_leaves_in_order() -> None:
    views = Views(0, range(3))
    views.joined(1, [0, 1, 2, 3], [3])
    views.gone(1)  # a failure: the next epoch, without it
    assert views.current == MembershipView(2, (0, 2, 3), (), (1,))
    assert await views.after(0) == MembershipView(1, (0, 1, 2, 3), (3,))
    # A notice of an epoch already passed never moves the view back.
    views.joined(1, [0, 1, 2, 3], [3])
    assert views.current.epoch == 2


async def test_watch_yields_every_view_once_in_epoch_order() -> None:
    views = Views(0, range(2))
    seen: list[int] = []

    async def watch() -> None:
        async for view in views.watch():
            seen.append(view.epoch)
            if view.epoch == 3:
                return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await anyio.lowlevel.checkpoint()
            views.joined(1, [0, 1, 2], [2])
            views.gone(0)  # two changes before the watcher runs again: both are seen
            views.joined(3, [1, 2, 3], [3])
    assert seen == [0, 1, 2, 3]


async def test_newcomer_waits_for_its_first_view() -> None:
    views = Views(-1, [5])
    views.gone(2)  # before its first view: that view counts this change already
    assert views.current.epoch == -1
    views.joined(4, [0, 1, 5], [5])
    with anyio.fail_after(5):
        assert (await views.after(-1)).epoch == 4


def test_views_keep_a_bounded_history() -> None:
    views = Views(0, range(2))
    for epoch in range(1, 3 * MAX_VIEWS):
        views.joined(epoch, [0, 1], [])
    assert len(views.history) == MAX_VIEWS


def test_replace_failed_makes_the_job_elastic_and_replacements_get_no_rank() -> None:
    spec = LaunchSpec(["x"], nproc=4, replace_failed=True)
    env = rank_env(spec, 3, ("127.0.0.1", 1), "job", {"RANK": "9"}, replacement=True)
    assert env["AIODIST_MAX_WORLD_SIZE"] == "4"
    assert env["WORLD_SIZE"] == "4"
    assert "RANK" not in env  # the server gives it the next free rank
    assert env["LOCAL_RANK"] == "3"
    first = rank_env(spec, 3, ("127.0.0.1", 1), "job", {})
    assert first["RANK"] == "3"
    assert "AIODIST_MAX_WORLD_SIZE" not in rank_env(
        LaunchSpec(["x"], nproc=4), 0, ("h", 1), "j", {}
    )


def test_nnodes_min_max_is_torchruns() -> None:
    spec = LaunchSpec(
        ["x"], nproc=2, nnodes=2, max_nnodes=4, node_rank=3, master_addr="h", master_port=7
    )
    env = rank_env(spec, 1, ("h", 7), "job", {})
    assert env["WORLD_SIZE"] == "4"  # MIN nodes' ranks form the job
    assert env["AIODIST_MAX_WORLD_SIZE"] == "8"
    assert "RANK" not in env  # a node past MIN joins the formed job
    with pytest.raises(ValueError, match="MIN <= MAX"):
        LaunchSpec(["x"], nproc=2, nnodes=3, max_nnodes=2)


def test_cli_refuses_a_malformed_nnodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--nnodes", "2:x", "script.py"]) == 2
    assert "--nnodes must be N or MIN:MAX" in capsys.readouterr().err
