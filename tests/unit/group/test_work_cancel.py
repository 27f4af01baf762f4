"""``Work.cancel``: a receive nothing matched yet is withdrawn, as ``MPI_Cancel`` does.

Real server, real clients and sockets on 127.0.0.1 (``run_ranks``), and the
sans-IO matcher for the withdrawal itself.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

from aiodist._ops.p2p import irecv, isend
from aiodist._ops.p2p_objects import irecv_object, isend_object
from aiodist._plane.matching import Matcher
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer


def test_matcher_withdraws_a_posted_receive_and_the_next_message_goes_on() -> None:
    m: Matcher[str, str] = Matcher()
    key = (1, 0, 9, 0)
    assert m.post(0, key, "first") is None
    assert m.post(None, key, "any") is None
    assert m.withdraw(0, key, "first")
    assert not m.withdraw(0, key, "first")  # once
    assert not m.withdraw(1, key, "any")  # posted for any source, not for rank 1
    assert m.arrive(0, key) == "any"  # the withdrawn one takes nothing
    assert m.arrive(0, key) is None
    assert len(m) == 0


@pytest.mark.parametrize("src", [0, None])
async def test_timed_out_receive_withdrawn_leaves_the_next_message_to_the_next_receive(
    server: RendezvousServer, src: int | None
) -> None:
    async def body(g: ProcessGroup) -> Any:
        if g.rank == 0:
            await irecv_object(src=1, tag=1, group=g)  # rank 1 withdrew its receive
            await isend_object("second", dst=1, tag=9, group=g)
            return None
        w = irecv_object(src=src, tag=9, group=g)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(w, 0.3)  # the issue's own steps
        withdrawn = w.cancel()
        again = w.cancel()
        await isend_object("go", dst=0, tag=1, group=g)
        got = await irecv_object(src=src, tag=9, group=g)
        with pytest.raises(asyncio.CancelledError):
            w.result()
        return withdrawn, again, w.is_completed(), got

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    # Before: no cancel(); the timed-out receive took "second" and the next one hung.
    assert outs[1] == (True, False, True, "second")


async def test_receive_that_matched_is_not_withdrawn(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> Any:
        if g.rank == 0:
            await isend(torch.arange(3.0), dst=1, tag=4, group=g)
            return None
        t = torch.zeros(3)
        w = irecv(t, src=0, tag=4, group=g)
        sender = await w
        return w.cancel(), sender, t.tolist()

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == (False, 0, [0.0, 1.0, 2.0])


async def test_send_is_not_withdrawn(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> Any:
        if g.rank == 0:
            w = isend_object({"x": 1}, dst=1, tag=2, group=g)
            cancelled = w.cancel()
            await w
            return cancelled
        return await irecv_object(src=0, tag=2, group=g)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [False, {"x": 1}]


async def test_cancel_from_another_thread_withdraws_the_receive(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> Any:
        if g.rank == 0:
            await irecv_object(src=1, tag=1, group=g)
            await isend_object(7, dst=1, tag=3, group=g)
            return None
        w = irecv_object(src=0, tag=3, group=g)
        withdrawn = await anyio.to_thread.run_sync(w.cancel)  # as from aiodist.sync code
        await isend_object("go", dst=0, tag=1, group=g)
        return withdrawn, await irecv_object(src=0, tag=3, group=g)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    assert outs[1] == (True, 7)
