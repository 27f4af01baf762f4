"""A user's transport, public: registered by name, chosen per job and per peer pair.

The transport is the one in ``examples/crc_transport.py``: TCP over asyncio
streams, each frame with a CRC32.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist import transport as public
from aiodist._transport import registry
from aiodist.testing import check_data_channel, run_ranks
from tests.helpers import ROOT

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

    from aiodist import ProcessGroup, RendezvousServer

EXAMPLE = ROOT / "examples" / "crc_transport.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crc_transport_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass-free classes still want a home
    spec.loader.exec_module(module)
    return module


crc = _load_example()


@pytest.fixture
def registered() -> Iterator[Any]:
    transport = crc.CrcTransport()
    aiodist.register_transport("crc", transport)
    try:
        yield transport
    finally:
        public.unregister_transport("crc")


async def test_example_transport_passes_the_conformance_suite() -> None:
    with anyio.fail_after(60):
        await check_data_channel(crc.CrcTransport())


async def test_crc_channel_refuses_a_corrupted_frame() -> None:
    # One byte flipped in transit: the receiver closes the connection, delivers nothing.
    closed = anyio.Event()
    got: list[Any] = []

    class Sink:
        exc: Exception | None = None

        def frame_received(self, channel: Any, frame: Any) -> None:
            channel.handshake_done()
            got.append(frame.header)

        def payload_received(self, channel: Any, frame: Any) -> None:
            pass

        def channel_closed(self, channel: Any, exc: Exception | None) -> None:
            Sink.exc = exc
            closed.set()

    transport = crc.CrcTransport()
    listener = await transport.listen("127.0.0.1", Sink)
    try:
        host, _, port = listener.address.removeprefix("crc://").rpartition(":")
        async with await anyio.connect_tcp(host, int(port)) as stream:
            body = b"".join(bytes(p) for p in public.encode_frame(65, ["hello"]))
            head = crc.HEAD.pack(len(body), crc.zlib.crc32(body))
            await stream.send(head + body)
            bad = bytearray(b"".join(bytes(p) for p in public.encode_frame(65, ["x"], b"data")))
            good_crc = crc.zlib.crc32(bad)
            bad[-1] ^= 1
            await stream.send(crc.HEAD.pack(len(bad), good_crc) + bad)
            with anyio.fail_after(10):
                await closed.wait()
    finally:
        listener.close()
    assert got == [["hello"]]
    assert isinstance(Sink.exc, aiodist.ProtocolError)
    assert "CRC32" in str(Sink.exc)


def test_register_transport_checks_name_scheme_and_shape() -> None:
    with pytest.raises(ValueError, match="built-in"):
        aiodist.register_transport("tcp", crc.CrcTransport())
    with pytest.raises(ValueError, match="lowercase"):
        aiodist.register_transport("Not A Name", crc.CrcTransport())
    with pytest.raises(TypeError, match="listen"):
        aiodist.register_transport("nothing", object())  # type: ignore[arg-type]

    class TakesTcp(crc.CrcTransport):  # type: ignore[misc, name-defined]
        scheme = "tcp"

    with pytest.raises(ValueError, match="belongs to transport 'tcp'"):
        aiodist.register_transport("mine", TakesTcp())
    aiodist.register_transport("crc", crc.CrcTransport())
    try:
        with pytest.raises(ValueError, match="already"):
            aiodist.register_transport("crc", crc.CrcTransport())
        aiodist.register_transport("crc", crc.CrcTransport(), replace=True)
        assert "crc" in public.registered()
    finally:
        public.unregister_transport("crc")
    assert "crc" not in public.registered()


async def test_an_unknown_transport_name_fails_before_joining(server: RendezvousServer) -> None:
    with pytest.raises(ValueError, match="no data-plane transport is called 'nope'") as info:
        async with aiodist.open_process_group(
            f"tcp://{server.address[0]}:{server.address[1]}", world_size=1, transport="nope"
        ):
            pass
    assert "register_transport" in str(info.value)
    assert server.num_connections == 0  # refused before it connected


@pytest.mark.parametrize("world_size", [2, 3])
async def test_job_on_a_registered_transport_runs_its_collectives_over_it(
    server: RendezvousServer, registered: Any, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> Any:
        members = await g.session.members()
        t = torch.ones(1 << 18) * (g.rank + 1)  # 1 MiB
        await aiodist.all_reduce(t, group=g)
        objs = await aiodist.all_gather_object(g.rank, group=g)
        big = torch.empty(1 << 19)  # 2 MiB: a large p2p, announced and cleared
        nxt, prev = (g.rank + 1) % g.world_size, (g.rank - 1) % g.world_size
        w = aiodist.irecv(big, prev, group=g)
        await aiodist.isend(torch.full((1 << 19,), float(g.rank)), nxt, group=g)
        await w
        return (
            [a.split(":")[0] for a in members[g.rank].addresses],
            float(t[0]),
            objs,
            float(big[0]),
            {type(c).__name__ for c in g.session.plane.routes.values()},
        )

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, world_size, body, transport="crc")
    total = float(sum(range(1, world_size + 1)))
    for rank, (schemes, reduced, objs, got, kinds) in enumerate(outs):
        assert schemes == ["crc"]  # what it listens on: crc alone, no shared memory either
        assert reduced == total
        assert objs == list(range(world_size))
        assert got == float((rank - 1) % world_size)
        assert kinds == {"CrcChannel"}
    assert sum(c.frames_checked for c in registered.channels) > 0


@pytest.mark.parametrize(("first", "kind"), [(0, "CrcChannel"), (1, "StreamChannel")])
async def test_each_peer_pair_uses_the_first_scheme_of_the_peer_it_can(
    server: RendezvousServer, registered: Any, first: int, kind: str
) -> None:
    # Rank 0 listens on TCP only; rank 1 on crc, then TCP. The rank that sends first
    # connects, with the first scheme of the other's addresses it has a transport for:
    # rank 0 reaches rank 1 over crc, rank 1 reaches rank 0 over TCP. The reply rides
    # the channel the first message opened.
    async def one(rank: int, transport: str, out: dict[int, Any]) -> None:
        async with aiodist.open_process_group(
            f"tcp://{server.address[0]}:{server.address[1]}",
            world_size=2,
            rank=rank,
            group_name=f"pairs-{first}",
            transport=transport,
        ) as g:
            other, got = 1 - rank, torch.empty(4)
            if rank != first:
                await aiodist.recv(got, other, group=g)
            await aiodist.send(torch.full((4,), float(rank)), other, group=g)
            route = type(g.session.plane.routes[other]).__name__  # what that send went on
            if rank == first:
                await aiodist.recv(got, other, group=g)
            members = await g.session.members()
            schemes = [a.split(":")[0] for a in members[rank].addresses]
            out[rank] = (float(got[0]), route, schemes)

    out: dict[int, Any] = {}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0, "tcp", out)
            tg.start_soon(one, 1, "crc,tcp", out)
    assert out[0] == (1.0, kind, ["tcp"])
    assert out[1] == (0.0, kind, ["crc", "tcp"])


def test_entry_point_transport_is_found_by_name_and_by_scheme(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = importlib.metadata.EntryPoint(
        name="crc", value="crc_transport_example:transport", group=registry.ENTRY_POINT_GROUP
    )

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [entry] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        assert registry.by_scheme("crc") is crc.transport
        assert registry.get_transport("crc") is crc.transport
    finally:
        public.unregister_transport("crc")
