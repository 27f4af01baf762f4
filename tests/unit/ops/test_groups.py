"""Subgroups made with ``new_group``: membership, isolation, ordering, bad input."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import anyio
import pytest
import torch

import aiodist
from aiodist import ClosedError, CollectiveMismatchError, ProcessGroup, RendezvousServer
from aiodist.testing import run_ranks


@pytest.mark.parametrize(("world_size", "members"), [(2, [1]), (3, [0, 2]), (5, [4, 1, 3])])
async def test_subgroup_all_reduce_sums_members_only(
    server: RendezvousServer, world_size: int, members: list[int]
) -> None:
    async def body(world: ProcessGroup) -> tuple[int, int, float | None]:
        g = await aiodist.new_group(members, parent=world)
        if world.rank not in members:
            # As in torch.distributed: a collective on a group this process is not in
            # does nothing, at once; the group's size is -1 here.
            t = torch.ones(1)
            w = aiodist.all_reduce(t, group=g)
            assert w.is_completed()
            assert w.result() is t
            assert t.tolist() == [1.0]
            assert aiodist.get_world_size(g) == -1
            assert aiodist.get_rank(g) == -1
            return g.rank, g.world_size, None
        t = torch.full((3,), float(world.rank))
        await aiodist.all_reduce(t, group=g)
        return g.rank, g.world_size, float(t[0])

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, world_size, body)
    ranks = sorted(members)
    for rank, (group_rank, size, total) in enumerate(outs):
        assert size == len(members)
        if rank in members:
            assert group_rank == ranks.index(rank)
            assert total == float(sum(members))
        else:
            assert (group_rank, total) == (-1, None)


async def test_overlapping_subgroups_and_world_run_interleaved(server: RendezvousServer) -> None:
    # Four ranks, groups {0,1,2} and {1,2,3}; each rank starts its operations on
    # every group it is in, in a different interleaving, before awaiting any.
    async def body(world: ProcessGroup) -> list[list[Any]]:
        low = await aiodist.new_group([0, 1, 2], parent=world)
        high = await aiodist.new_group([1, 2, 3], parent=world)
        mine = [g for g in (low, high, world) if g.rank >= 0]
        random.Random(world.rank).shuffle(mine)
        works = [
            (g, aiodist.all_gather_object((g.name, step, world.rank), group=g))
            for step in range(5)
            for g in mine
        ]
        out = []
        for g, w in works:
            got = await w
            assert [name for name, _, _ in got] == [g.name] * g.world_size
            out.append([r for _, _, r in got])
        return out

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 4, body)
    for rank, results in enumerate(outs):
        expected = {(0, 1, 2), (1, 2, 3), (0, 1, 2, 3)}
        seen = {tuple(r) for r in results}
        assert seen <= expected
        assert len(results) == 5 * (2 if rank in (0, 3) else 3)


async def test_subgroup_object_gather_and_barrier(server: RendezvousServer) -> None:
    async def body(world: ProcessGroup) -> list[Any] | None:
        g = await aiodist.new_group([1, 2], parent=world)
        if g.rank < 0:
            return None
        await aiodist.barrier(group=g)
        return await aiodist.all_gather_object({"rank": world.rank}, group=g)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [None, [{"rank": 1}, {"rank": 2}], [{"rank": 1}, {"rank": 2}]]


async def test_new_group_with_different_ranks_raises_mismatch_on_every_rank(
    server: RendezvousServer,
) -> None:
    async def body(world: ProcessGroup) -> dict[int, Any]:
        ranks = [0, 1] if world.rank == 0 else [0, 2]
        with pytest.raises(CollectiveMismatchError, match="different ranks") as info:
            await aiodist.new_group(ranks, parent=world)
        assert info.value.field == "ranks"
        return dict(info.value.values_by_rank)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [{0: [0, 1], 1: [0, 2], 2: [0, 2]}] * 3


@pytest.mark.parametrize(
    ("ranks", "error", "match"),
    [
        ([0, 0], ValueError, "distinct"),
        ([0, 5], ValueError, "not a member"),
        ([0, True], TypeError, "must be ints"),
        ([], ValueError, "at least one"),
        ("01", TypeError, "sequence of ints"),
    ],
)
async def test_new_group_bad_ranks_raise_before_sending(
    server: RendezvousServer, ranks: Any, error: type[Exception], match: str
) -> None:
    async def body(world: ProcessGroup) -> int:
        with pytest.raises(error, match=match):
            await aiodist.new_group(ranks, parent=world)
        # No data was sent; every rank took its place (a group id and a sequence
        # number) and aborted it, so the next group still agrees on both.
        g = await aiodist.new_group([0, 1], parent=world)
        await aiodist.all_reduce(torch.ones(1), group=g)
        return g.group_id

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [2, 2]


async def test_destroyed_subgroup_raises_closed_and_world_keeps_working(
    server: RendezvousServer,
) -> None:
    async def body(world: ProcessGroup) -> float:
        g = await aiodist.new_group(parent=world)
        await aiodist.destroy_process_group(g)  # only the subgroup; the job goes on
        with pytest.raises(ClosedError, match="destroyed"):
            aiodist.all_reduce(torch.ones(1), group=g)
        t = torch.ones(1)
        await aiodist.all_reduce(t, group=world)
        return float(t[0])

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [2.0, 2.0]


async def test_new_group_needs_init() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        await aiodist.new_group([0])


async def test_subgroup_roots_and_peers_are_global_ranks_as_in_torch(
    server: RendezvousServer,
) -> None:
    # Group {1, 3} of 4 ranks: src/dst name global ranks; results report global ranks.
    async def body(world: ProcessGroup) -> tuple[Any, ...] | None:
        g = await aiodist.new_group([1, 3], parent=world)
        if g.rank < 0:
            return None
        with pytest.raises(ValueError, match="src=2 is not a member"):
            aiodist.broadcast(torch.zeros(1), src=2, group=g)
        t = torch.full((2,), float(world.rank))
        await aiodist.broadcast(t, src=3, group=g)
        gathered = await aiodist.gather(torch.tensor([world.rank]), dst=1, group=g)
        objs = [f"from {world.rank}"]
        await aiodist.broadcast_object_list(objs, src=1, group=g)
        if world.rank == 1:
            await aiodist.send(torch.tensor([7.0]), dst=3, group=g)
            sender = None
        else:
            got = torch.zeros(1)
            sender = await aiodist.recv(got, src=None, group=g)
            assert float(got[0]) == 7.0
        return float(t[0]), [int(x) for x in gathered], objs[0], sender

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 4, body)
    assert outs == [
        None,
        (3.0, [1, 3], "from 1", None),
        None,
        (3.0, [], "from 1", 1),
    ]


async def test_barrier_timeout_names_the_ranks_that_never_arrived(
    server: RendezvousServer,
) -> None:
    late = anyio.Event()
    gave_up: list[str] = []

    async def body(world: ProcessGroup) -> str:
        if world.rank == 2:  # never calls this barrier
            # Collectives start when called: wait until this rank has heard that the
            # group broke (the receive fails then), or all_reduce would meet the others'
            # barrier messages and report that mismatch instead.
            notice = aiodist.irecv(torch.zeros(1), src=0, group=world)
            await late.wait()
            with pytest.raises(aiodist.DistTimeoutError):
                await notice
            with pytest.raises(aiodist.DistTimeoutError) as info:
                await aiodist.all_reduce(torch.ones(1), group=world)  # the group is broken
            return str(info.value)
        with pytest.raises(aiodist.DistTimeoutError) as info:
            # Long enough for ranks 0 and 1 to reach each other on a loaded machine.
            await aiodist.barrier(group=world, timeout=3.0)
        gave_up.append(str(info.value))
        if len(gave_up) == 2:
            late.set()
        return str(info.value)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    for rank, message in enumerate(outs):
        assert "ranks [2] never arrived" in message, (rank, message)
    with pytest.raises(ValueError, match="timeout must be"):
        aiodist.barrier(timeout=0)


async def test_subgroup_mismatch_breaks_only_that_group(server: RendezvousServer) -> None:
    async def body(world: ProcessGroup) -> tuple[str | None, float]:
        g = await aiodist.new_group([0, 1, 2], parent=world)
        field = None
        if g.rank >= 0:
            t = torch.ones(2)

            # A rank whose turn comes after the others already found the mismatch gets
            # the error from the call itself; the others get it from the Work.
            def start() -> aiodist.Work[Any]:
                if world.rank == 0:
                    return aiodist.all_reduce(t, group=g)
                return aiodist.broadcast(t, src=1, group=g)

            with pytest.raises(CollectiveMismatchError) as info:
                await start()
            field = info.value.field
            with pytest.raises(CollectiveMismatchError):  # the subgroup stays broken
                await aiodist.barrier(group=g)
        t = torch.ones(1)
        await aiodist.all_reduce(t, group=world)  # the world group is untouched
        return field, float(t[0])

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 4, body)
    assert [o[1] for o in outs] == [4.0] * 4
    assert outs[3][0] is None
    assert {o[0] for o in outs[:3]} == {"op"}


async def test_monitored_barrier_names_the_missing_rank_within_its_timeout(
    server: RendezvousServer,
) -> None:
    # As torch's monitored_barrier: a RuntimeError that names the rank that never came.
    late = anyio.Event()
    caught: list[BaseException] = []

    async def body(world: ProcessGroup) -> float | None:
        if world.rank == 1:  # never calls it
            notice = aiodist.irecv(torch.zeros(1), src=0, group=world)
            await late.wait()
            with pytest.raises(aiodist.DistTimeoutError):
                await notice
            return None
        began = anyio.current_time()
        with pytest.raises(RuntimeError) as info:
            await aiodist.monitored_barrier(world, timeout=timedelta(seconds=0.5))
        caught.append(info.value)
        late.set()
        return anyio.current_time() - began

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    (exc,) = caught
    assert isinstance(exc, aiodist.BarrierTimeoutError)
    assert isinstance(exc, aiodist.DistTimeoutError)
    assert exc.ranks == [1]
    assert "monitored_barrier" in str(exc)
    seconds = outs[0]
    assert seconds is not None
    assert 0.4 < seconds < 3.0


async def test_group_queries_as_torch_answers_them(server: RendezvousServer) -> None:
    async def body(world: ProcessGroup) -> list[object]:
        odd = await aiodist.new_group([1, 2], parent=world)
        mine, groups = await aiodist.new_subgroups(1, group=world)
        split = await aiodist.split_group(world, [[0, 2], [1]])
        answers: list[object] = [
            aiodist.get_world_size(odd),
            aiodist.get_rank(odd),
            odd.size(),
            [g.ranks for g in groups],
            mine.ranks,
            None if split is None else split.ranks,
        ]
        if odd.rank >= 0:
            answers.append(aiodist.get_group_rank(odd, 2))
            answers.append(aiodist.get_global_rank(odd, 0))
            with pytest.raises(ValueError, match="not a member"):
                aiodist.get_group_rank(odd, 0)
            with pytest.raises(ValueError, match="not part of group"):
                aiodist.get_global_rank(odd, 5)
        return answers

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    every = [[0], [1], [2]]
    assert outs[0] == [-1, -1, 2, every, [0], [0, 2]]
    assert outs[1] == [2, 0, 2, every, [1], [1], 1, 1]
    assert outs[2] == [2, 1, 2, every, [2], [0, 2], 1, 1]
