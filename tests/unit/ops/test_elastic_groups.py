"""shrink_group on N clients in one loop (real server, real sockets): groups, arguments.

A member "dies" by closing its control connection without leaving, as a killed
process's connection closes (``test_elastic.py`` kills real processes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest
import torch

import aiodist
from aiodist import ProcessGroup, RankFailedError
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import RendezvousServer


def _die(g: ProcessGroup) -> None:
    g.session.conn.close()  # no Leave: the server declares it failed


async def test_shrink_of_a_group_renumbers_and_groups_without_the_dead_rank_go_on(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> object:
        evens = await aiodist.new_group([0, 2], parent=g)
        if g.rank == 1:
            _die(g)
            return "gone"
        await g.session.trouble()  # the server's notice of rank 1
        with pytest.raises(RankFailedError) as info:
            await aiodist.all_reduce(torch.ones(1), group=g)
        assert info.value.rank == 1
        t = torch.full((2,), float(g.rank))
        await aiodist.all_reduce(t, group=evens)  # a group without rank 1 goes on
        assert t.tolist() == [2.0, 2.0]
        new = await aiodist.shrink_group([1], group=g)
        assert (new.rank, new.world_size, list(new.ranks)) == ({0: 0, 2: 1}[g.rank], 2, [0, 2])
        t = torch.full((3,), float(new.rank + 1))
        await aiodist.all_reduce(t, group=new)
        objs = await aiodist.all_gather_object({"was": g.rank}, group=new)
        return t.tolist(), objs

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body, heartbeat_timeout=2.0)
    assert outs[1] == "gone"
    for out in (outs[0], outs[2]):
        assert out == ([3.0, 3.0, 3.0], [{"was": 0}, {"was": 2}])


async def test_shrink_group_bad_arguments_raise_before_anything_is_sent(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> None:
        with pytest.raises(ValueError, match="this rank"):
            await aiodist.shrink_group([g.rank], group=g)
        with pytest.raises(ValueError, match="not a rank of"):
            await aiodist.shrink_group([5], group=g)
        with pytest.raises(ValueError, match="distinct"):
            await aiodist.shrink_group([1 - g.rank, 1 - g.rank], group=g)
        with pytest.raises(TypeError, match="ints"):
            await aiodist.shrink_group(["1"], group=g)  # type: ignore[list-item]
        # Nothing was sent: the group still works, on both ranks.
        t = torch.ones(1)
        await aiodist.all_reduce(t, group=g)
        assert t.item() == 2.0

    with anyio.fail_after(15):
        await run_ranks(server.address, 2, body)


async def test_shrink_group_callers_that_disagree_get_the_same_error(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> str:
        exclude = {0: [2], 1: [], 2: [0]}[g.rank]
        with pytest.raises(aiodist.DistError) as info:
            await aiodist.shrink_group(exclude, group=g, timeout=5.0)
        return f"{type(info.value).__name__}: {info.value}"

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0].startswith("CollectiveMismatchError"), outs[0]
    assert "same ranks_to_exclude" in outs[0]


async def test_a_rank_the_others_left_out_is_told_so(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> object:
        if g.rank == 0:
            new = await aiodist.shrink_group([1], group=g)
            await g.store.set("shrunk", b"1")
            return list(new.ranks)
        await g.store.wait(["shrunk"])
        with pytest.raises(aiodist.GroupBrokenError, match="was left out") as info:
            await aiodist.shrink_group([0], group=g)
        return str(info.value)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    assert outs[0] == [0]
