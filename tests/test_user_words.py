"""Errors name the calls the user made, and say what torch says (issue 33, items 8, 11).

Real server, real clients and sockets on 127.0.0.1 (``run_ranks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from aiodist import CollectiveMismatchError
from aiodist._ops.groups import new_groups
from aiodist._ops.objects import all_gather_object
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer


async def test_new_group_called_by_its_members_only_names_new_group(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        try:
            if g.rank in (0, 1):
                await new_groups([[0, 1]], parent=g)  # rank 2 never calls new_group
            else:
                await all_gather_object({"x": 1}, group=g)
        except CollectiveMismatchError as exc:
            return exc.field, str(exc)
        return None

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    # Before: "ranks disagree on the op of collective 'all_gather_object'" on every rank.
    for rank, out in enumerate(outs):
        assert out is not None, outs
        field, message = out
        assert field == "op", out
        assert "'new_group'" in message, (rank, message)
    assert "collective 'new_group'" in outs[0][1]
    assert "collective 'all_gather_object'" in outs[2][1]
