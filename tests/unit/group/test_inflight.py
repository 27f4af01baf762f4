"""Operations in flight: callback-driven handles, group deadlines, eager sends."""

from __future__ import annotations

import anyio
import pytest
import torch

import aiodist
from aiodist import DistTimeoutError, ProcessGroup, RendezvousServer
from aiodist._ops.exchange import ONE_ROUND_MAX_RANKS
from aiodist._ops.p2p import irecv, isend
from aiodist.testing import run_ranks


@pytest.mark.parametrize("world_size", [ONE_ROUND_MAX_RANKS, ONE_ROUND_MAX_RANKS + 1])
async def test_all_reduce_called_after_every_peer_sent_still_sends_its_part(
    server: RendezvousServer, world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 calls all_reduce only once the others' messages are in: its handle could
    # complete at call time, but only after its own part went out to everyone (in one
    # round, everyone with everyone; through rank 0, all the rows back to every rank).
    # Over sockets: with shared memory, the rows go through the group's board instead.
    monkeypatch.setenv("AIODIST_SHM", "0")

    async def body(g: ProcessGroup) -> list[float]:
        await aiodist.all_reduce(torch.zeros(1), group=g)  # connections up
        t = torch.tensor([float(g.rank + 1)])
        if g.rank == 0:
            for src in range(1, g.world_size):
                await irecv(torch.zeros(1), src=src, tag=7, group=g)  # after src's part
            assert g.session.plane.matcher.num_unexpected == g.world_size - 1
            await aiodist.all_reduce(t, group=g)
        else:
            w = aiodist.all_reduce(t, group=g)
            await isend(torch.zeros(1), dst=0, tag=7, group=g)  # same channel: in order
            await w
        return t.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, world_size, body)
    total = float(sum(range(1, world_size + 1)))
    assert outs == [[total]] * world_size


async def test_unmatched_receive_times_out_and_breaks_the_group_everywhere(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> tuple[str, str]:
        if g.rank == 1:
            g.timeout = 1.0  # for this rank's operations only; joining kept the default
            w = irecv(torch.zeros(1), src=0, tag=1, group=g)  # rank 0 never sends it
            with pytest.raises(DistTimeoutError) as info:
                await w
            assert g.error is info.value  # broken here, with that error
            return "timed out", str(info.value)
        # Rank 0 learns from rank 1's notice: its own pending receive fails with it.
        with pytest.raises(DistTimeoutError) as info:
            await irecv(torch.zeros(1), src=1, tag=2, group=g)
        with pytest.raises(DistTimeoutError):
            aiodist.all_reduce(torch.ones(1), group=g)  # refused before anything is sent
        return "told", str(info.value)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1][0] == "timed out"
    assert "irecv(src=0, tag=1)" in outs[1][1]
    assert "timed out after 1.0 s" in outs[1][1]
    assert outs[0] == ("told", outs[1][1])  # the same error on both ranks


async def test_collective_one_rank_skips_times_out_on_the_others(
    server: RendezvousServer,
) -> None:
    skipped = anyio.Event()

    async def body(g: ProcessGroup) -> str:
        g.timeout = 1.0
        if g.rank == 2:
            await skipped.wait()
            return "skipped"
        with pytest.raises(DistTimeoutError) as info:
            await aiodist.all_gather_object({"rank": g.rank}, group=g)  # runs as a task
        if g.rank == 0:
            skipped.set()
        return str(info.value)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 3, body)
    assert "all_gather_object#1" in outs[0]
    assert "timed out" in outs[1]
    assert outs[2] == "skipped"


async def test_finished_operations_do_not_pile_up_behind_a_pending_one(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> int:
        other = 1 - g.rank
        stuck = irecv(torch.zeros(1), src=other, tag=99, group=g)  # matched at the end
        for _ in range(3000):
            w = irecv(torch.zeros(1), src=other, group=g)
            await isend(torch.ones(1), dst=other, group=g)
            await w
        held = len(g.deadlines.running())
        queued = len(g.deadlines._entries)
        await isend(torch.ones(1), dst=other, tag=99, group=g)
        await stuck
        assert held == 1
        return queued

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    # Finished entries behind the pending receive are dropped, not kept for its timeout.
    assert all(q <= 2048 for q in outs), outs


async def test_work_awaited_by_two_tasks_survives_one_being_cancelled(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[object] | None:
        if g.rank == 0:
            await g.store.wait(["ready"])
            await isend(torch.full((2,), 5.0), dst=1, group=g)
            return None
        t = torch.zeros(2)
        w = irecv(t, src=0, group=g)
        got: list[object] = []
        called = anyio.Event()

        def on_done(work: aiodist.Work[int]) -> None:
            got.append(work.result())
            called.set()

        w.add_done_callback(on_done)

        async def waiter() -> None:
            got.append(await w)

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await w  # cancelled before it could wait: the receive goes on
            tg.start_soon(waiter)
            await g.store.set("ready", b"")
            await called.wait()
        assert w.is_completed()
        return [*got, t.tolist()]

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == [0, 0, [5.0, 5.0]]
