"""Large all_gather outputs: reused once the caller dropped them, never while still used."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest
import torch

import aiodist
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer

NUMEL = 1 << 18  # 1 MiB of float32 per rank: outputs of 2 MiB and more are kept


def _part(rank: int, k: int) -> torch.Tensor:
    return torch.full((NUMEL,), float(10 * k + rank))


@pytest.mark.parametrize("shm_on", ["1", "0"], ids=["shared-memory", "ring"])
async def test_all_gather_outputs_held_by_the_caller_are_never_overwritten(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch, shm_on: str
) -> None:
    monkeypatch.setenv("AIODIST_SHM", shm_on)

    async def body(g: ProcessGroup) -> list[bool]:
        n = g.world_size
        held = await aiodist.all_gather(_part(g.rank, 0), group=g)  # kept whole
        view = (await aiodist.all_gather(_part(g.rank, 1), group=g))[1][5:9]  # a view only
        array = (await aiodist.all_gather(_part(g.rank, 2), group=g))[0].numpy()  # numpy only
        last = await aiodist.all_gather(_part(g.rank, 3), group=g)
        return [
            all(torch.equal(held[r], _part(r, 0)) for r in range(n)),
            bool(torch.all(view == 11.0)),
            bool((array == 20.0).all()),
            all(torch.equal(last[r], _part(r, 3)) for r in range(n)),
            len({t.data_ptr() for t in held + last}) == 2 * n,  # no memory shared
        ]

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [[True] * 5] * 2


async def test_all_gather_reuses_outputs_the_caller_dropped(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> tuple[bool, bool]:
        first = await aiodist.all_gather(_part(g.rank, 0), group=g)
        pointers = [t.data_ptr() for t in first]
        del first
        second = await aiodist.all_gather(_part(g.rank, 1), group=g)
        reused = [t.data_ptr() for t in second] == pointers
        right = all(torch.equal(second[r], _part(r, 1)) for r in range(g.world_size))
        return reused, right

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [(True, True)] * 2
