"""Helpers for testing code that uses aiodist: many ranks in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from aiodist._errors import ProtocolError
from aiodist._group.join import open_process_group
from aiodist._wire.preauth import PreAuthLimits

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from aiodist._group.group import ProcessGroup
    from aiodist._transport.base import DataChannel, Transport
    from aiodist._wire.frame import Frame

__all__ = ["check_data_channel", "run_ranks"]

T = TypeVar("T")
_job_ids = itertools.count()
# The suite's handshake: the first frame each way says this, without a payload, and
# its receiver lifts the channel's pre-handshake limits (as the data plane does).
_HELLO = ["hello"]


async def run_ranks(
    address: tuple[str, int],
    world_size: int,
    body: Callable[[ProcessGroup], Awaitable[T]],
    *,
    ranks: Sequence[int] | None = None,
    group_name: str | None = None,
    hostnames: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Join ``world_size`` clients to the server at ``address`` and run ``body`` on each.

    Every client is a task of the calling event loop with its own control
    connection, as separate processes would have.

    Args:
        address: The rendezvous server's ``(host, port)``.
        world_size: Number of clients.
        body: Called with each client's world group once the job has formed.
        ranks: Explicit rank per client (default: automatic ranks).
        group_name: The job's name (default: a fresh one per call).
        hostnames: The host each client counts as (default: this machine's name).
        **kwargs: Passed to ``open_process_group``.

    Returns:
        ``body``'s results in rank order.
    """
    name = group_name or f"test-job-{next(_job_ids)}"
    results: dict[int, T] = {}

    async def one(i: int) -> None:
        async with open_process_group(
            f"tcp://{address[0]}:{address[1]}",
            world_size=world_size,
            rank=-1 if ranks is None else ranks[i],
            group_name=name,
            hostname=None if hostnames is None else hostnames[i],
            **kwargs,
        ) as group:
            results[group.rank] = await body(group)

    async with anyio.create_task_group() as tg:
        for i in range(world_size):
            tg.start_soon(one, i)
    return [results[r] for r in range(world_size)]


class _RecordingSink:
    """A FrameSink that keeps every frame it receives, payload bytes included.

    With ``handshake``, the first frame is the peer's hello: it lifts the channel's
    limits and is not kept.
    """

    def __init__(self, *, handshake: bool = True) -> None:
        self.frames: list[tuple[int, Any, bytes]] = []
        self.arrived = asyncio.Event()
        self.closed = asyncio.Event()
        self.close_exc: Exception | None = None
        self._buf: bytearray | None = None
        self._hello_pending = handshake

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        if self._hello_pending:
            assert frame.header == _HELLO, f"expected the hello first, got {frame.header!r}"
            channel.handshake_done()
        self._buf = bytearray(frame.payload_nbytes)
        return memoryview(self._buf) if frame.payload_nbytes else None

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        if self._hello_pending:
            self._hello_pending = False
            return
        self.frames.append((frame.kind, frame.header, bytes(self._buf or b"")))
        self.arrived.set()

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        self.close_exc = exc
        self.closed.set()

    async def wait_for(self, n: int) -> None:
        while len(self.frames) < n:
            self.arrived.clear()
            await self.arrived.wait()


async def check_data_channel(transport: Transport, host: str = "127.0.0.1") -> None:
    """Check that ``transport`` behaves as the data plane needs; raise AssertionError if not.

    One conformance suite for every transport (as ``trio.testing.check_two_way_stream``
    is for streams), built in or registered (see ``aiodist.transport``): addresses
    that start with the transport's scheme, frames of many sizes both ways and in
    order, payloads landing in the receiver's memory intact, concurrent senders
    never interleaving frames,
    ``send`` (and what ``send_nowait`` returns) completing only once the payload
    may be reused, ``send_nowait`` keeping call order, clean close seen as
    clean, and abort seen by the peer; and before the handshake
    (``handshake_done``), the listener's limits: no payload, a byte budget, a
    deadline, the oldest silent unproved connection (before any that spoke) shed
    for a newer one beyond the cap, and the unproved ones closed with the listener.
    """
    accepted: list[_RecordingSink] = []
    new_sink = asyncio.Event()
    handshake = True

    def factory() -> _RecordingSink:
        sink = _RecordingSink(handshake=handshake)
        accepted.append(sink)
        new_sink.set()
        return sink

    async def accepted_sink(i: int) -> _RecordingSink:
        while len(accepted) <= i:
            new_sink.clear()
            await new_sink.wait()
        return accepted[i]

    async def connect(address: str) -> tuple[DataChannel, _RecordingSink]:
        sink = _RecordingSink()
        channel = await transport.connect(address, sink)
        await channel.send(65, _HELLO)
        channel.handshake_done()
        return channel, sink

    scheme = getattr(transport, "scheme", None)
    assert isinstance(scheme, str), f"a transport names its address scheme; got {scheme!r}"
    listener = await transport.listen(host, factory)
    try:
        # Peers pick the transport that reaches a rank by the scheme its address starts with.
        assert listener.address.startswith(f"{scheme}:"), (
            f"listener address {listener.address!r} does not start with {scheme!r}:"
        )
        channel, client_sink = await connect(listener.address)
        sizes = [0, 1, 7, 4096, 65_535, 65_536, 1_000_003, 8 * 1024 * 1024]
        payloads = [os.urandom(n) for n in sizes]
        for i, payload in enumerate(payloads):
            await channel.send(65, [i, "header"], payload or None)
        server_sink = await accepted_sink(0)
        await server_sink.wait_for(len(sizes))
        got = server_sink.frames
        assert [h for _, h, _ in got] == [[i, "header"] for i in range(len(sizes))], "order"
        assert [p for _, _, p in got] == payloads, "payload bytes differ"

        # Reusing the payload's memory after send() returns must not change what arrives.
        buf = bytearray(b"a" * (4 * 1024 * 1024))
        await channel.send(65, ["reuse"], memoryview(buf))
        buf[:] = b"b" * len(buf)
        await server_sink.wait_for(len(sizes) + 1)
        assert server_sink.frames[-1][2] == b"a" * len(buf), "send returned before the data left"

        # Concurrent senders: each frame arrives whole.
        blobs = [bytes([i]) * (300_000 + i) for i in range(16)]
        await asyncio.gather(*(channel.send(65, ["c", i], blob) for i, blob in enumerate(blobs)))
        await server_sink.wait_for(len(sizes) + 1 + len(blobs))
        tail = server_sink.frames[-len(blobs) :]
        assert sorted((h[1], p) for _, h, p in tail) == list(enumerate(blobs)), "interleaved"

        # send_nowait: written in call order with send; what it returns (if anything)
        # completes once the payload may be reused.
        done_before = len(server_sink.frames)
        big = bytearray(b"x" * (4 * 1024 * 1024))
        finishing = []  # what send_nowait left to do runs in tasks, as the data plane's does
        sends: list[bytes | memoryview] = [b"small", memoryview(big)]
        for i, data in enumerate(sends):
            rest = channel.send_nowait(65, ["now", i], data)
            if rest is not None:
                finishing.append(asyncio.ensure_future(rest))
        await channel.send(65, ["now", 2], None)
        await asyncio.gather(*finishing)
        big[:] = b"y" * len(big)
        await server_sink.wait_for(done_before + 3)
        now = server_sink.frames[done_before:]
        assert [h for _, h, _ in now] == [["now", 0], ["now", 1], ["now", 2]], "send_nowait order"
        assert now[1][2] == b"x" * len(big), "send_nowait's wait ended before the data left"

        # The other direction works on the accepted side's channel too (replies).
        assert client_sink.frames == []

        channel.close()
        await server_sink.closed.wait()
        assert server_sink.close_exc is None, f"clean close reported {server_sink.close_exc!r}"

        # Abort is visible to the peer.
        other, _ = await connect(listener.address)
        await other.send(65, ["after the hello"], None)
        second = await accepted_sink(1)
        await second.wait_for(1)
        other.abort()
        await second.closed.wait()
    finally:
        listener.close()

    await _check_preauth(transport, host)


async def _check_preauth(transport: Transport, host: str) -> None:
    """``check_data_channel``'s limits before the handshake (the listener's side never proves)."""
    accepted: list[_RecordingSink] = []
    new_sink = asyncio.Event()

    def factory() -> _RecordingSink:
        accepted.append(_RecordingSink(handshake=False))
        new_sink.set()
        return accepted[-1]

    async def connect(address: str) -> tuple[DataChannel, _RecordingSink, _RecordingSink]:
        """A connection that has not proved itself: its sink, and the accepted side's."""
        sink = _RecordingSink(handshake=False)
        n = len(accepted)
        channel = await transport.connect(address, sink)
        while len(accepted) <= n:
            new_sink.clear()
            await new_sink.wait()
        return channel, sink, accepted[n]

    def refused(sink: _RecordingSink) -> bool:
        return sink.closed.is_set() and isinstance(sink.close_exc, ProtocolError)

    limits = PreAuthLimits(max_bytes=4096, deadline=60.0, max_pending=3)
    listener = await transport.listen(host, factory, preauth=limits)
    try:
        # A payload before the handshake: refused at its frame's prefix.
        channel, _, theirs = await connect(listener.address)
        with contextlib.suppress(OSError):
            await channel.send(65, ["early"], b"payload")
        await theirs.closed.wait()
        assert refused(theirs), f"a payload before the handshake: {theirs.close_exc!r}"
        assert theirs.frames == [], "a payload before the handshake was delivered"

        # Small frames, each acceptable: refused once they add up to the byte budget.
        channel, _, theirs = await connect(listener.address)
        with contextlib.suppress(OSError):
            for i in range(limits.max_bytes // 16):  # each frame is over 16 bytes
                await channel.send(65, [i])
        await theirs.closed.wait()
        assert refused(theirs), f"over the byte budget: {theirs.close_exc!r}"
        assert len(theirs.frames) < limits.max_bytes // 16, "the byte budget was not enforced"

        # Beyond max_pending unproved connections, a newcomer sheds the oldest of those
        # that said nothing (a real peer speaks at once: it is not shed for a stranger).
        talking, talker, theirs = await connect(listener.address)
        await talking.send(65, ["not proved yet"])
        await theirs.wait_for(1)
        _, oldest, _ = await connect(listener.address)
        _, middle, _ = await connect(listener.address)
        _, newest, _ = await connect(listener.address)
        await oldest.closed.wait()
        assert not talker.closed.is_set(), "shed a connection that spoke before a silent one"
        assert not middle.closed.is_set(), "shed a silent connection that was not the oldest"
        assert not newest.closed.is_set(), "shed the newcomer"
    finally:
        listener.close()
    # Closing the listener closes the connections that never proved themselves.
    for sink in (talker, middle, newest):
        await sink.closed.wait()

    # A connection that says nothing is closed at the deadline.
    listener = await transport.listen(host, factory, preauth=PreAuthLimits(deadline=0.2))
    try:
        _, mine, theirs = await connect(listener.address)
        await mine.closed.wait()
        await theirs.closed.wait()
        assert refused(theirs), f"past the deadline: {theirs.close_exc!r}"
    finally:
        listener.close()
