"""Members hear their server go away and come back (the real server, restarted in-process)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import anyio
import torch

import aiodist
from aiodist import open_process_group, serve_rendezvous
from aiodist._control.channel import ServerAway, ServerBack

if TYPE_CHECKING:
    from pathlib import Path

    import pytest
    from anyio.abc import TaskStatus

    from aiodist import RendezvousServer
    from aiodist._control.channel import Notice
    from aiodist._group.group import ProcessGroup


async def test_members_hear_the_server_go_away_and_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_SERVER_GRACE", "30")
    state = str(tmp_path / "state")
    heard: dict[int, list[Notice]] = {0: [], 1: []}
    joined = [anyio.Event(), anyio.Event()]
    away = [anyio.Event(), anyio.Event()]
    back = [anyio.Event(), anyio.Event()]
    sums: list[float] = []

    async def rank(url: str, r: int) -> None:
        async with open_process_group(url, world_size=2, rank=r, group_name="away") as g:
            channel = g.session.conn
            forward = channel.on_notice
            assert forward is not None

            def spy(notice: Notice) -> None:
                if isinstance(notice, ServerAway | ServerBack):
                    heard[r].append(notice)
                    (away if isinstance(notice, ServerAway) else back)[r].set()
                forward(notice)

            channel.on_notice = spy
            joined[r].set()
            await back[r].wait()
            assert not channel.server_away
            sums.append(float((await _sum(g, r)).item()))
            assert g.session.error is None

    first_scope = anyio.CancelScope()
    first_gone = anyio.Event()

    async def first_server(*, task_status: TaskStatus[RendezvousServer]) -> None:
        try:
            with first_scope:
                await serve_rendezvous("127.0.0.1", 0, state_dir=state, task_status=task_status)
        finally:
            first_gone.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as servers:
            server: RendezvousServer = await servers.start(first_server)
            port = server.address[1]
            async with anyio.create_task_group() as ranks:
                for r in range(2):
                    ranks.start_soon(rank, f"tcp://127.0.0.1:{port}", r)
                for event in joined:
                    await event.wait()
                first_scope.cancel()  # it stops, telling its members that it will come back
                await first_gone.wait()
                for event in away:
                    await event.wait()
                await servers.start(
                    functools.partial(serve_rendezvous, "127.0.0.1", port, state_dir=state)
                )
            servers.cancel_scope.cancel()
    assert sums == [1.0, 1.0]
    for r in range(2):
        assert [type(n) for n in heard[r]] == [ServerAway, ServerBack], heard[r]
        assert "restarting" in heard[r][0].why  # type: ignore[union-attr]


async def _sum(g: ProcessGroup, r: int) -> torch.Tensor:
    t = torch.tensor([float(r)])
    await aiodist.all_reduce(t, group=g)
    return t
