"""The data plane between real sockets on 127.0.0.1: joining races."""

from __future__ import annotations

import anyio
import pytest

from aiodist._peers import COLLECTIVE, DataPlane


def _plane(lost: list[tuple[int, str]]) -> DataPlane:
    async def on_peer_lost(rank: int, why: str) -> None:
        lost.append((rank, why))

    return DataPlane("job", on_peer_lost=on_peer_lost)


@pytest.mark.parametrize("use_uds", [True, False], ids=["uds", "tcp"])
async def test_hello_before_the_member_table_is_accepted(use_uds: bool) -> None:
    # Rank 0 got the job's member table first and sends at once; rank 1 has not
    # processed its own copy yet. The message must wait for it, not break the job.
    lost: list[tuple[int, str]] = []
    a, b = _plane(lost), _plane(lost)
    a.use_uds = b.use_uds = use_uds
    addresses = {0: tuple(await a.listen("127.0.0.1")), 1: tuple(await b.listen("127.0.0.1"))}

    async def table() -> dict[int, tuple[str, ...]]:
        return addresses

    try:
        a.set_members(0, 2, table, [0, 0])
        key = (COLLECTIVE, 0, 1, 0)
        future = b.recv(0, key)
        with anyio.fail_after(10):
            await a.send(1, key, ["meta"], b"payload")
            msg = await future
        b.set_members(1, 2, table, [0, 0])
        assert (msg.src, msg.meta, bytes(msg.data)) == (0, ["meta"], b"payload")
        with anyio.fail_after(10):  # and the channel it adopted still works both ways
            back = a.recv(1, key)
            await b.send(0, key, ["reply"], b"")
            assert (await back).meta == ["reply"]
        assert lost == []
    finally:
        await a.aclose()
        await b.aclose()
