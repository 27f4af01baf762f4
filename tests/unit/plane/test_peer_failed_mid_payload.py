"""A peer declared failed while one of its payloads is arriving: that receive fails too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from aiodist import RankFailedError
from aiodist._plane.peers import DataPlane
from aiodist._rpc.wire import RPC_GROUP
from aiodist._wire.frame import encode_frame, encode_message
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import Data, PeerHello

if TYPE_CHECKING:
    from aiodist._wire.keys import Key


@pytest.mark.parametrize(
    "key",
    [(MatchKind.P2P, 0, 3, 0), (MatchKind.RPC, RPC_GROUP, 7, 0)],
    ids=["p2p", "rpc"],
)
async def test_receive_cut_off_mid_payload_fails_when_its_sender_is_declared_failed(
    monkeypatch: pytest.MonkeyPatch, key: Key
) -> None:
    # A rank freezes (SIGSTOP) halfway through a payload; the server then declares it
    # failed, and its connection is dropped. Receives of no group of its (a p2p receive,
    # the tensor of an rpc reply) fail only through the notice of that rank: the one
    # whose payload was arriving must fail too, not wait for bytes that never come (an
    # rpc call stuck so kept rpc.shutdown from ever completing).
    plane = DataPlane("job")
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
    dest = memoryview(bytearray(1 << 20))
    future = plane.recv(0, key, dest)
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with anyio.fail_after(10):
            async with await anyio.connect_tcp(host, int(port)) as frozen_rank:
                hello = encode_message(PeerHello("job", 0, 1234, 0))
                data = encode_frame(Data.KIND, [*key, None], dest)
                wire = b"".join(bytes(p) for p in hello + data)
                await frozen_rank.send(wire[: len(wire) - dest.nbytes // 2])  # half of it
                await header_in.wait()
                plane.peer_failed(0, RankFailedError("rank 0 failed", rank=0))
                with pytest.raises(RankFailedError):
                    await future
        assert plane.orphans == []
        assert not plane.arriving
    finally:
        await plane.aclose()
