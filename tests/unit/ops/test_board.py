"""Small collectives through shared memory, on the group's board (``_ops.board``).

Real clients of the real in-process server; the ranks of one host (all of them,
unless ``hostnames`` says otherwise) write their rows into their own segments.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import anyio
import pytest
import torch

from aiodist import (
    CollectiveMismatchError,
    DistError,
    ProcessGroup,
    RankFailedError,
    RendezvousServer,
)
from aiodist._ops import board
from aiodist._ops.agreement import signature
from aiodist._ops.board import Board
from aiodist._ops.exchange import Exchange, exchange_rows
from aiodist._ops.movement import barrier
from aiodist._ops.reductions import all_reduce
from aiodist._ops.rooted import broadcast
from aiodist._transport import shmrows
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist._group.work import Work

pytestmark = pytest.mark.skipif(
    not shmrows.supported(), reason="the board needs x86-64 and a writable /dev/shm"
)


@pytest.mark.parametrize("world_size", [2, 3, 5])
async def test_small_collectives_take_the_board_and_send_nothing(
    server: RendezvousServer, world_size: int
) -> None:
    # More calls in flight than a rank has slots: the later ones wait for a slot.
    calls = 3 * shmrows.SLOTS

    async def body(g: ProcessGroup) -> tuple[int, list[list[float]], list[float]]:
        await all_reduce(torch.ones(1), group=g)  # decides the board
        assert isinstance(g.rows, Board)
        assert g.rows.ready
        plane = g.session.plane
        side = board._side(plane)
        sent = plane.messages_sent - side.bells  # a bell wakes a rank that stopped polling
        works = [
            all_reduce(torch.full((3,), float(g.rank + i)), group=g, async_op=True)
            for i in range(calls)
        ]
        await barrier(group=g)
        mean = torch.tensor([float(g.rank), 2.0 * g.rank])
        await all_reduce(mean, op="mean", group=g)
        results = [(await w).tolist() for w in works]
        return plane.messages_sent - side.bells - sent, results, mean.tolist()

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, world_size, body)
    ranks = sum(range(world_size))
    expected = [[float(ranks + world_size * i)] * 3 for i in range(calls)]
    mean = [ranks / world_size, 2.0 * ranks / world_size]
    assert outs == [(0, expected, mean)] * world_size


async def test_ranks_of_two_hosts_keep_to_sockets(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> tuple[object, int, list[float]]:
        t = torch.tensor([float(g.rank + 1)])
        sent = g.session.plane.messages_sent
        await all_reduce(t, group=g)
        return g.rows, g.session.plane.messages_sent - sent, t.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body, hostnames=["a", "b"])
    assert [(rows, sent > 0, t) for rows, sent, t in outs] == [("off", True, [3.0])] * 2


async def test_broadcast_opens_on_the_board_and_sends_its_data(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[list[float]]:
        got = []
        for root in range(g.world_size):
            t = torch.full((5,), float(g.rank))
            await broadcast(t, src=root, group=g)
            got.append(t.tolist())
        return got

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [[[float(root)] * 5 for root in range(3)]] * 3


async def test_rows_longer_than_a_slot_agree_on_the_board_and_go_over_sockets(
    server: RendezvousServer,
) -> None:
    n = shmrows.ROW_MAX + 8

    async def body(g: ProcessGroup) -> tuple[bool, int]:
        await barrier(group=g)  # decides the board
        plane = g.session.plane
        sent = plane.messages_sent
        seq = g.take_seq()
        work: Work[memoryview] = g.begin("rows", seq=seq)
        mine = signature("rows", shape=[n])
        row = memoryview(bytes([g.rank + 1]) * n)

        def done(rows: memoryview) -> None:
            work.set_result(rows)

        exchange_rows(Exchange(g, work, seq, mine, rides=True), row, done)
        rows = await work
        expected = b"".join(bytes([r + 1]) * n for r in range(g.world_size))
        return bytes(rows) == expected, plane.messages_sent - sent

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert [ok for ok, _ in outs] == [True] * 3
    assert all(sent > 0 for _, sent in outs)


async def test_ranks_that_disagree_on_the_board_all_fail(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> str:
        await barrier(group=g)  # decides the board
        with pytest.raises(CollectiveMismatchError) as info:
            await all_reduce(torch.ones(2 + g.rank), group=g)
        return info.value.field

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 3, body)
    assert outs == ["shape"] * 3


@pytest.mark.parametrize("on_sockets", [0, 1, 2])
async def test_a_rank_on_sockets_beside_ranks_on_the_board_fails_them_all(
    server: RendezvousServer, on_sockets: int
) -> None:
    # Rank ``on_sockets`` reduces a tensor too large for the board's path (another
    # algorithm, over sockets); the others a small one, on the board.
    async def body(g: ProcessGroup) -> str:
        await barrier(group=g)  # decides the board
        numel = 70_001 if g.rank == on_sockets else 3
        with pytest.raises(DistError) as info:
            await all_reduce(torch.ones(numel), group=g)
        return type(info.value).__name__

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 3, body)
    assert set(outs) <= {"CollectiveMismatchError", "GroupBrokenError"}, outs
    assert "CollectiveMismatchError" in outs


async def test_a_rank_that_writes_late_rings_the_ranks_that_stopped_polling(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without its bell the others would sleep until the fallback look, an hour away.
    monkeypatch.setattr(board, "SLEEP", 3600.0)

    async def body(g: ProcessGroup) -> tuple[int, list[float]]:
        await barrier(group=g)  # decides the board
        side = board._side(g.session.plane)
        rung = side.bells
        t = torch.tensor([float(g.rank + 1)])
        if g.rank == 1:
            await anyio.sleep(0.2)  # far past the others' polling
        await all_reduce(t, group=g)
        await g.session.barrier()  # on the server: no rank leaves before all are done
        return side.bells - rung, t.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert [t for _, t in outs] == [[6.0]] * 3
    assert outs[1][0] >= 1  # rank 1 found the others asleep and rang


async def test_more_ranks_than_the_host_has_cpus_for_keep_to_sockets(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(board, "RANKS_PER_CPU", 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    async def body(g: ProcessGroup) -> tuple[object, list[float]]:
        t = torch.tensor([float(g.rank + 1)])
        await all_reduce(t, group=g)
        return g.rows, t.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [("off", [6.0])] * 3


async def test_a_slot_a_reader_never_acknowledged_is_free_again_once_the_group_broke(
    server: RendezvousServer,
) -> None:
    # Rank 2 writes its row and never looks again, as a rank stopped right after writing
    # and then declared failed: it acknowledges no one's row. Held until it did, the
    # others' slots would stay taken for good, and sixteen such breaks would leave a rank
    # no slot at all.
    groups: dict[int, ProcessGroup] = {}
    all_in, written, checked = anyio.Event(), anyio.Event(), anyio.Event()
    looked: list[int] = []

    async def body(g: ProcessGroup) -> tuple[bool, bool] | None:
        await barrier(group=g)  # decides the board
        groups[g.rank] = g
        if len(groups) == g.world_size:
            all_in.set()
        await all_in.wait()
        side = board._side(g.session.plane)
        seq = g.take_seq()
        work: Work[memoryview] = g.begin("rows", seq=seq)
        ex = Exchange(g, work, seq, signature("rows", shape=[8]), rides=True)

        def done(rows: memoryview) -> None:
            work.set_result(rows)

        exchange_rows(ex, memoryview(bytes([g.rank]) * 8), done)
        if g.rank == 2:
            side.ops.clear()  # written; it never looks again
            written.set()
            await checked.wait()  # alive: the rows of a rank that left are not waited for
            return None
        await written.wait()
        assert bytes(await work) == bytes([0] * 8 + [1] * 8 + [2] * 8)
        (slot,) = [i for i, op in enumerate(side.owner) if op is not None and op.ex is ex]
        op = side.owner[slot]
        assert op is not None
        before = op.acknowledged(side, slot)
        g.break_(RankFailedError("rank 2 failed", rank=groups[2].session.rank), notify=False)
        after = op.acknowledged(side, slot)
        looked.append(g.rank)
        if len(looked) == 2:
            checked.set()
        return before, after

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert outs[:2] == [(False, True)] * 2
