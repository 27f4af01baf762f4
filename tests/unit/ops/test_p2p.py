"""Point-to-point and Work handles with the real server and real sockets."""

from __future__ import annotations

import random
import threading
from typing import Any

import anyio
import pytest
import torch

import aiodist
from aiodist import ClosedError, CollectiveMismatchError, ProcessGroup, RendezvousServer, Work
from aiodist._ops.p2p import irecv, isend, recv, send
from aiodist._ops.p2p_objects import irecv_object, isend_object
from aiodist.testing import run_ranks


async def test_send_recv_tensor_values_and_sender_rank(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> tuple[int, list[float]] | None:
        if g.rank == 0:
            await send(torch.arange(5, dtype=torch.float64), dst=1, group=g)
            return None
        t = torch.zeros(5, dtype=torch.float64)
        return await recv(t, src=0, group=g), t.tolist()

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == (0, [0.0, 1.0, 2.0, 3.0, 4.0])


async def test_recv_from_any_source_reports_each_sender(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[tuple[int, int]] | None:
        if g.rank != 0:
            await send(torch.tensor([g.rank * 10]), dst=0, group=g)
            return None
        got = []
        for _ in range(g.world_size - 1):
            t = torch.zeros(1, dtype=torch.int64)
            src = await recv(t, group=g)
            got.append((src, int(t.item())))
        return sorted(got)

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 4, body)
    assert outs[0] == [(1, 10), (2, 20), (3, 30)]


async def test_messages_with_one_tag_arrive_in_send_order_and_tags_match(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[int] | None:
        if g.rank == 0:
            works = [isend(torch.tensor([i]), dst=1, tag=i % 2, group=g) for i in range(20)]
            for w in works:
                await w
            return None
        # Receive tag 1 first although tag 0 messages were sent first: they wait, buffered.
        odd = [torch.zeros(1, dtype=torch.int64) for _ in range(10)]
        even = [torch.zeros(1, dtype=torch.int64) for _ in range(10)]
        for t in odd:
            await recv(t, src=0, tag=1, group=g)
        for t in even:
            await recv(t, src=0, tag=0, group=g)
        return [int(t.item()) for t in even + odd]

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == list(range(0, 20, 2)) + list(range(1, 20, 2))


async def test_large_and_non_contiguous_tensors(server: RendezvousServer) -> None:
    big = torch.randn(16 * 1024 * 1024)  # 64 MiB
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)

    async def body(g: ProcessGroup) -> bool:
        if g.rank == 0:
            await send(big, dst=1, group=g)
            await send(base.t(), dst=1, tag=1, group=g)  # non-contiguous source
            return True
        got = torch.empty_like(big)
        await recv(got, src=0, group=g)
        dest = torch.zeros(4, 6).t()  # non-contiguous destination
        await recv(dest, src=0, tag=1, group=g)
        return torch.equal(got, big) and torch.equal(dest, base.t())

    with anyio.fail_after(30):
        assert await run_ranks(server.address, 2, body) == [True, True]


async def test_many_operations_in_flight_complete_in_any_order(server: RendezvousServer) -> None:
    n = 100

    async def body(g: ProcessGroup) -> list[int] | None:
        peer = 1 - g.rank
        outs = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        recvs = [irecv(outs[i], src=peer, tag=i, group=g) for i in range(n)]
        order = list(range(n))
        random.Random(g.rank).shuffle(order)
        sends = [isend(torch.tensor([g.rank * 1000 + i]), dst=peer, tag=i, group=g) for i in order]
        shuffled = recvs + sends
        random.Random(7 + g.rank).shuffle(shuffled)
        for w in shuffled:
            await w
        assert all(w.is_completed() for w in recvs + sends)
        return [int(t.item()) for t in outs]

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs[0] == [1000 + i for i in range(n)]
    assert outs[1] == list(range(n))


async def test_objects_point_to_point(server: RendezvousServer) -> None:
    payloads = [{"a": (1, 2)}, "text", [None, 1.5], {1, 2, 3}, torch.ones(3)]

    async def body(g: ProcessGroup) -> list[object] | None:
        if g.rank == 0:
            for i, obj in enumerate(payloads):
                await isend_object(obj, dst=1, tag=i, group=g)
            return None
        return [await irecv_object(src=0, tag=i, group=g) for i in reversed(range(len(payloads)))]

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    got = list(reversed(outs[1]))  # type: ignore[arg-type]
    assert got[:4] == payloads[:4]
    assert torch.equal(got[4], payloads[4])  # type: ignore[arg-type]


async def test_object_p2p_has_the_set_up_of_tensor_p2p(server: RendezvousServer) -> None:
    """Outside the group, to itself, in the flight recorder: objects as tensors."""

    async def body(world: ProcessGroup) -> list[Any]:
        g = await aiodist.new_group([0, 1], parent=world)
        out: list[Any] = []
        if g.rank < 0:  # outside: done at once, nothing sent or received
            sends = [isend_object("x", dst=0, group=g), isend(torch.ones(1), dst=0, group=g)]
            assert all(w.is_completed() and w.result() is None for w in sends)
            out += [await irecv_object(src=0, group=g), await irecv(torch.ones(1), group=g)]
            return out
        with pytest.raises(ValueError, match="should not be the same as the rank"):
            isend_object("to myself", dst=world.rank, group=g)
        if g.rank == 0:
            await isend_object({"n": 1}, dst=1, group=g)
        else:
            out.append(await irecv_object(src=0, group=g))
        rec = world.session.recorder
        assert rec is not None
        out.append(sorted({e.name for e in rec.entries()} & {"isend_object", "irecv_object"}))
        return out

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [[["isend_object"]], [{"n": 1}, ["irecv_object"]], [None, -1]]


async def test_recv_with_other_dtype_raises_mismatch_on_receiver(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> str:
        if g.rank == 0:
            await send(torch.ones(4, dtype=torch.float32), dst=1, group=g)
            return "sent"
        with pytest.raises(CollectiveMismatchError) as info:
            await recv(torch.zeros(4, dtype=torch.int64), src=0, group=g)
        assert info.value.field == "dtype"
        assert info.value.values_by_rank == {1: "int64", 0: "float32"}
        return "refused"

    with anyio.fail_after(10):
        assert await run_ranks(server.address, 2, body) == ["sent", "refused"]


async def test_bad_arguments_raise_before_sending(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> None:
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            isend([1, 2], dst=1 - g.rank, group=g)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"dst=\d+ is not a member"):
            isend(torch.ones(1), dst=5, group=g)
        with pytest.raises(ValueError, match="tag must be"):
            irecv(torch.ones(1), src=0, tag=-1, group=g)

    with anyio.fail_after(10):
        await run_ranks(server.address, 2, body)


async def test_cancelling_the_awaiter_does_not_cancel_the_receive(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> float | None:
        if g.rank == 1:
            t = torch.zeros(2)
            w = irecv(t, src=0, group=g)
            with anyio.move_on_after(0.05):
                await w  # the peer has not sent yet: this times out
            assert not w.is_completed()
            await g.store.set("cancelled", b"")
            assert await w == 0
            return float(t.sum())
        await g.store.wait(["cancelled"])
        await send(torch.ones(2), dst=1, group=g)
        return None

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == 2.0


async def test_work_wait_from_another_thread_and_not_on_the_loop(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> int | None:
        if g.rank == 1:
            w = irecv(torch.zeros(1), src=0, group=g)
            with pytest.raises(RuntimeError, match="has not completed"):
                w.result()
            with pytest.raises(RuntimeError, match="deadlock"):
                w.wait()
            box: list[int] = []
            thread = threading.Thread(target=lambda: box.append(w.wait(timeout=10)))
            thread.start()
            await g.store.set("waiting", b"")
            await anyio.to_thread.run_sync(thread.join)
            return box[0]
        await g.store.wait(["waiting"])
        await send(torch.ones(1), dst=1, group=g)
        return None

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == 0


async def test_closing_the_group_fails_unmatched_receives_instead_of_waiting(
    server: RendezvousServer,
) -> None:
    # No rank ever sends: the receives must not hold the close for the group's timeout.
    async def body(g: ProcessGroup) -> list[Work[Any]]:
        return [irecv(torch.zeros(1), src=None, group=g), irecv_object(src=None, tag=3, group=g)]

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    for works in outs:
        for w in works:
            assert w.is_completed()
            assert isinstance(w.exception(), ClosedError)
