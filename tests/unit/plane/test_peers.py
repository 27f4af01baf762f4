"""The data plane between real sockets on 127.0.0.1: joining races."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from aiodist import RankFailedError
from aiodist._plane.peers import DataPlane
from aiodist._wire.frame import encode_frame
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import Data, PeerHello

if TYPE_CHECKING:
    from aiodist._wire.keys import Key


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
        key = (MatchKind.COLLECTIVE, 0, 1, 0)
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


async def test_a_failure_reaches_a_receive_whose_payload_is_still_arriving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank dies halfway through sending: the server's notice of it can come before
    # the data connection reports the loss. The receive has left the matcher by then,
    # and must still fail rather than wait for bytes that never come.
    dropped = anyio.Event()

    async def on_peer_lost(rank: int, why: str) -> None:
        dropped.set()

    plane = DataPlane("job", on_peer_lost=on_peer_lost)
    plane.use_uds = False
    (address,) = [a for a in await plane.listen("127.0.0.1") if a.startswith("tcp://")]
    header_in = anyio.Event()
    arrive = plane.matcher.arrive

    def arrive_and_tell(src: int, key: Key) -> object:
        found = arrive(src, key)
        header_in.set()
        return found

    monkeypatch.setattr(plane.matcher, "arrive", arrive_and_tell)

    async def table() -> dict[int, tuple[str, ...]]:
        return {}

    plane.set_members(1, 2, table, [0, 0])
    key = (MatchKind.COLLECTIVE, 0, 1, 0)
    dest = memoryview(bytearray(1 << 20))
    future = plane.recv(0, key, dest)
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with anyio.fail_after(10):
            async with await anyio.connect_tcp(host, int(port)) as dead_rank:
                hello = encode_frame(PeerHello.KIND, ["job", 0, 1234, 0, None], None)
                data = encode_frame(Data.KIND, [*key, None], dest)
                wire = b"".join(bytes(p) for p in hello + data)
                await dead_rank.send(wire[: len(wire) - dest.nbytes // 2])  # half the payload
                await header_in.wait()
                plane.fail(RankFailedError("rank 0 failed", rank=0))
                with pytest.raises(RankFailedError):
                    await future
            await dropped.wait()  # the connection then drops: nothing is left waiting
        assert plane.orphans == []
        assert not plane.arriving
    finally:
        await plane.aclose()
