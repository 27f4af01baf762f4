"""Members sharing one control connection, each on its own channel, against the real server."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist import (
    ClosedError,
    GroupBrokenError,
    RankFailedError,
    RendezvousServer,
    open_process_group,
)
from aiodist._control.channel import ControlChannel, ServerLost
from aiodist._control.connection import ControlConnection, connect_control
from aiodist._errors import ProtocolError
from aiodist._wire.frame import NEED_DATA, FrameDecoder, encode_message, frame_message
from aiodist._wire.messages import (
    Channel,
    Heartbeat,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    Reply,
    StatusRequest,
    StoreAdd,
    StoreCheck,
    StoreGet,
    StoreSet,
    Welcome,
)

if TYPE_CHECKING:
    from aiodist._control.channel import Notice


def _join(rank: int, job: str, world_size: int) -> Any:
    return lambda r: Join(r, job, world_size, rank, "host-a", 1000 + rank, [], 10.0, 5.0)


class _Notices:
    """Notices per channel name, and an event set once ``expected`` have come."""

    def __init__(self, expected: int) -> None:
        self.got: list[tuple[str, Notice]] = []
        self.expected = expected
        self.all_in = anyio.Event()

    def on(self, name: str) -> Any:
        def record(notice: Notice) -> None:
            self.got.append((name, notice))
            if len(self.got) >= self.expected:
                self.all_in.set()

        return record


async def _members(
    conn: ControlConnection, job: str, notices: _Notices, names: str
) -> list[ControlChannel]:
    channels = [conn.open_channel(notices.on(name)) for name in names]
    welcomes = []
    async with anyio.create_task_group() as tg:
        for rank, channel in enumerate(channels):

            async def join(channel: ControlChannel = channel, rank: int = rank) -> None:
                welcomes.append(await channel.request(_join(rank, job, len(names)), timeout=5))

            tg.start_soon(join)
    assert sorted(w.rank for w in welcomes) == list(range(len(names)))
    assert all(isinstance(w, Welcome) for w in welcomes)
    return channels


async def test_each_channel_is_a_member_of_its_own(server: RendezvousServer) -> None:
    notices = _Notices(expected=2)
    conn = await connect_control(*server.address, timeout=5)
    try:
        with anyio.fail_after(10):
            a, b, c = await _members(conn, "chan", notices, "abc")
            assert server.num_connections == 1
            assert len(server.state.jobs["chan"].members) == 3
            # Requests of any channel reach the job as its member's.
            assert await b.request(lambda r: StoreAdd(r, "n", 2), timeout=5) == 2
            assert await c.request(lambda r: StoreAdd(r, "n", 3), timeout=5) == 5
            # Closing a's channel is its member disconnecting: b and c are told, each on
            # its own channel, and a's job is broken for them.
            a.close()
            await notices.all_in.wait()
            assert sorted(name for name, _ in notices.got) == ["b", "c"]
            for _, notice in notices.got:
                assert isinstance(notice, MemberFailed)
                assert notice.rank == 0
                assert "channel was closed" in notice.reason
            # The store goes on after a failure (failure isolation).
            assert await b.request(lambda r: StoreAdd(r, "n", 1), timeout=5) == 6
            with pytest.raises(ClosedError):  # a closed channel refuses at once
                await a.request(lambda r: StoreAdd(r, "n", 1), timeout=5)
            # The connection itself still serves its other channels.
            status = await conn.request(StatusRequest, timeout=5)
            # One socket (the asking one, not counted) carrying 3 channels: its own, b's, c's.
            assert (status["connections"], status["channels"]) == (0, 3)
    finally:
        conn.close()
    await server.wait_until(lambda s: s.num_connections == 0 and not s.state.jobs)
    assert server.state.membership.conns == {}


async def test_a_lost_connection_fails_every_member_on_it(server: RendezvousServer) -> None:
    notices = _Notices(expected=1)
    shared = await connect_control(*server.address, timeout=5)
    own = await connect_control(*server.address, timeout=5)
    try:
        with anyio.fail_after(10):
            channels = [shared.open_channel(), shared.open_channel(), own.open_channel()]
            own_channel = channels[2]
            own_channel.on_notice = notices.on("own")
            async with anyio.create_task_group() as tg:
                for rank, channel in enumerate(channels):
                    tg.start_soon(channel.request, _join(rank, "lost", 3))
            pending: list[BaseException] = []

            async def wait_forever(channel: ControlChannel) -> None:
                with pytest.raises(GroupBrokenError) as info:
                    await channel.request(lambda r: StoreGet(r, "never", 30.0))
                pending.append(info.value)

            async with anyio.create_task_group() as tg:
                for channel in channels[:2]:
                    tg.start_soon(wait_forever, channel)
                await server.wait_until(lambda s: s.state.stats.store_ops >= 2)
                assert shared._transport is not None
                shared._transport.abort()  # as if the process of ranks 0 and 1 died
            assert len(pending) == 2  # both members' requests failed with the connection
            await notices.all_in.wait()
            (_, notice), *_ = notices.got
            assert isinstance(notice, MemberFailed)
            assert notice.rank in (0, 1)
            await server.wait_until(lambda s: s.num_connections == 1)
    finally:
        shared.close()
        own.close()


async def test_a_negative_channel_is_a_protocol_error(server: RendezvousServer) -> None:
    conn = await connect_control(*server.address, timeout=5)
    try:
        with anyio.fail_after(10):
            conn.send(Channel(-1))
            with pytest.raises(ProtocolError, match=r"Channel.channel must be an integer in \[0, "):
                await conn.request(StatusRequest, timeout=5)
            await server.wait_until(lambda s: s.num_connections == 0)
    finally:
        conn.close()


_FAILED_0 = MemberFailed(0, "host-a", 1000, "connection lost")


@pytest.mark.parametrize(
    "notices",
    [
        pytest.param([_FAILED_0], id="one-failure"),
        # Failures told together, then one of them again (as a re-attached member
        # hears every failure of its job): it counts once.
        pytest.param(
            [MembersFailed([[0, "host-a", 1000, "connection lost"]]), _FAILED_0],
            id="together-then-again",
        ),
    ],
)
async def test_a_failure_read_with_the_welcome_reaches_the_session(notices: list[Any]) -> None:
    # A server that sends the Welcome and, in the same write, the failure of rank 0:
    # the notice arrives before the member has a session to tell.
    hung_up = anyio.Event()

    async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        channel = 0
        while True:
            while (event := dec.next_event()) is NEED_DATA:
                data = await reader.read(65536)
                if not data:  # the member left and closed its connection
                    writer.close()
                    hung_up.set()
                    return
                dec.receive_data(data)
            msg = frame_message(event)  # type: ignore[arg-type]
            if isinstance(msg, Channel):
                channel = msg.channel
            elif isinstance(msg, Heartbeat):  # the client's probe: a server echoes it
                writer.writelines(encode_message(Heartbeat()))
            elif isinstance(msg, Join):
                writer.writelines(
                    [
                        *encode_message(Welcome(msg.req_id, 1, 2, 1, 2, [[0, 2]])),
                        *encode_message(Channel(channel)),
                        *(part for notice in notices for part in encode_message(notice)),
                    ]
                )
            elif isinstance(msg, Leave):
                writer.writelines(encode_message(Reply(msg.req_id, None)))

    srv = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with anyio.fail_after(10):
            async with open_process_group(f"tcp://127.0.0.1:{port}", world_size=2, rank=1) as g:
                # Only what needs rank 0 breaks: the group that holds it.
                assert g.session.error is None
                assert isinstance(g.error, RankFailedError)
                assert g.error.rank == 0
                view = g.session.views.current
                assert (view.epoch, view.ranks) == (1, (1,))  # one change, however told
                with pytest.raises(RankFailedError, match="rank 0"):
                    await aiodist.all_reduce(torch.ones(1), group=g)
            await hung_up.wait()
    finally:
        srv.close()


async def test_a_member_leaving_keeps_the_order_of_what_it_sent(server: RendezvousServer) -> None:
    # Several members on a connection: their messages wait for the end of the loop
    # iteration. A member that sends and closes in one go must have its message read
    # first, even though its close leaves one member (whose writes go out at once).
    conn = await connect_control(*server.address, timeout=5)
    try:
        with anyio.fail_after(10):
            a, b = await _members(conn, "order", _Notices(expected=1), "ab")
            b.send(StoreSet(9001, "x", b"1"))  # its reply answers no pending request
            b.close()
            assert await a.request(lambda r: StoreCheck(r, ["x"]), timeout=5) is True
    finally:
        conn.close()


async def test_the_server_dropping_a_connection_tells_every_member_on_it(
    server: RendezvousServer,
) -> None:
    # Not only pending requests fail: each member hears of it, even one with nothing
    # pending (a rank inside a collective learns that it lost its server).
    notices = _Notices(expected=2)
    conn = await connect_control(*server.address, timeout=5)
    try:
        with anyio.fail_after(10):
            await _members(conn, "dropped", notices, "ab")
            (server_side,) = server._hub.sockets
            assert server_side.transport is not None
            server_side.transport.abort()  # as if the server's process died
            await notices.all_in.wait()
    finally:
        conn.close()
    assert sorted(name for name, _ in notices.got) == ["a", "b"]
    errors = [notice.error for _, notice in notices.got if isinstance(notice, ServerLost)]
    assert len(errors) == 2
    assert errors[0] is errors[1] is conn.error  # one error, the connection's
    assert isinstance(errors[0], GroupBrokenError)
    assert f"rendezvous server at {server.address[0]}:{server.address[1]}" in str(errors[0])


async def test_a_busy_loop_does_not_count_as_the_servers_silence(
    server: RendezvousServer,
) -> None:
    # A loop that was busy sent no heartbeat, so the server had none to answer: only a
    # heartbeat left unanswered for the timeout counts the server as gone.
    conn = await connect_control(*server.address, timeout=5)
    try:
        with anyio.fail_after(10):
            conn.start_heartbeats(0.05, timeout=0.2)  # the first heartbeat goes now
            await conn.request(StatusRequest)  # answered after the heartbeat's echo
            assert conn.liveness.echoed
            # Busy: twice the timeout with no heartbeat sent (blocking the loop is the point).
            time.sleep(0.4)  # noqa: ASYNC251
            await conn.request(StatusRequest)  # the overdue heartbeat runs before this
            assert conn.error is None
    finally:
        conn.close()
