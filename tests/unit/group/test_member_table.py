"""The member table a rank fetches from the server, and a job that grows while it comes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import anyio

from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer


async def test_a_table_the_job_outgrew_while_it_came_is_not_kept(
    server: RendezvousServer,
) -> None:
    # A newcomer's notice can be handled between the table's reply and the fetch's
    # resuming: that table lacks the newcomer, and a rank that kept it could never
    # connect to it (the elastic pipeline's hang: a call to a replacement never left).
    async def body(g: ProcessGroup) -> bool:
        session = g.session
        loading = asyncio.ensure_future(session.members())
        await asyncio.sleep(0)  # the request is on its way
        session.forget_members()  # the job grew meanwhile, as ``Session._members_joined`` does
        came = await loading
        again = await session.members()
        return again is not came and again == came  # fetched anew (the same job here)

    with anyio.fail_after(15):
        assert await run_ranks(server.address, 2, body) == [True, True]
