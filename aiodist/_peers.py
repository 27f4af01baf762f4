"""The data plane of one session: listeners, lazy peer channels, matching.

Wire use: a channel opens with ``PEER_HELLO [job, rank, pid]`` from the side
that connected; every message after it is ``DATA [kind, group, a, b, meta]``
with a raw payload. ``(kind, group, a, b)`` is the match key: kind 0 for
tensor point-to-point (``a`` = tag), 1 for collectives (``a`` = sequence
number, ``b`` = step), 2 for object point-to-point. ``meta`` is small plain
data the operation checks (dtype, shape, op). ``PEER_ERROR`` carries an error
that breaks a group on every member; ``PEER_BYE`` precedes a clean close.

Each direction of a peer pair uses one channel, so messages from one source
with one key arrive in send order. A payload whose receive is already posted
is read straight into the receiver's memory; otherwise it is buffered once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ProtocolError
from aiodist._matching import Matcher
from aiodist._transport import shm, tcp, uds
from aiodist._wire.messages import MessageKind

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._transport.base import DataChannel, Listener
    from aiodist._wire.frame import Buffer, Frame

__all__ = ["DataPlane", "Key", "Received"]

logger = logging.getLogger(__name__)

Key = tuple[int, int, int, int]
P2P: Final = 0
COLLECTIVE: Final = 1
OBJECT_P2P: Final = 2


@dataclass(slots=True)
class Received:
    """A matched message: who sent it, its metadata, and where its payload is."""

    src: int
    meta: Any
    data: memoryview


@dataclass(slots=True, eq=False)
class _Posted:
    future: asyncio.Future[Received]
    dest: memoryview | None
    key: Key


class _Link:
    """The frame sink of one channel: knows the peer's rank once it said hello."""

    def __init__(self, plane: DataPlane, src: int | None = None) -> None:
        self.plane = plane
        self.src = src
        self.said_bye = False
        self._posted: _Posted | None = None
        self._buffer: memoryview | None = None
        self._meta: Any = None
        self._key: Key = (0, 0, 0, 0)

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        kind, header = frame.kind, frame.header
        if kind == MessageKind.DATA:
            if self.src is None:
                raise ProtocolError("DATA before PEER_HELLO")
            if not isinstance(header, list) or len(header) != 5:
                raise ProtocolError("malformed DATA header")
            key: Key = (header[0], header[1], header[2], header[3])
            self._key, self._meta = key, header[4]
            posted = self.plane.matcher.arrive(self.src, key)
            self._posted = posted
            nbytes = frame.payload_nbytes
            if posted is not None and posted.dest is not None and posted.dest.nbytes == nbytes:
                self._buffer = posted.dest
            else:  # unexpected, or a size mismatch the receiver reports: buffer it
                self._buffer = memoryview(bytearray(nbytes))
            return self._buffer if nbytes else None
        if kind == MessageKind.PEER_HELLO:
            job, rank, _pid = header
            # A peer that got the job's member table first may say hello before this rank
            # got it (world_size still 0): accept it; set_members checks the rank later.
            known = self.plane.world_size
            if job != self.plane.job or not 0 <= rank < (known or rank + 1):
                raise ProtocolError(f"peer hello from job {job!r} rank {rank} does not belong here")
            self.src = rank
            self.plane._adopt(rank, channel)
        elif kind == MessageKind.PEER_ERROR:
            if self.src is not None:
                self.plane.on_peer_error(self.src, header)
        elif kind == MessageKind.PEER_BYE:
            self.said_bye = True
        else:
            raise ProtocolError(f"unexpected frame kind {kind} on a data channel")
        return None

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        if frame.kind != MessageKind.DATA:
            return
        assert self.src is not None
        assert self._buffer is not None
        msg = Received(self.src, self._meta, self._buffer)
        posted, self._posted, self._buffer = self._posted, None, None
        if posted is None:
            # A receive may have been posted while this payload was in flight.
            posted = self.plane.matcher.arrive(self.src, self._key)
        if posted is None:
            self.plane.matcher.buffer(self.src, self._key, msg)
        else:
            self.plane._complete(posted, msg)

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        self.plane._channel_closed(self, channel, exc)


class DataPlane:
    """Channels to every peer of a session, and the receives waiting on them."""

    def __init__(
        self,
        job: str,
        *,
        on_peer_lost: Callable[[int, str], None],
        on_peer_error: Callable[[int, Any], None],
    ) -> None:
        self.job = job
        self.rank = -1
        self.world_size = 0
        self.matcher: Matcher[_Posted, Received] = Matcher()
        self.on_peer_lost = on_peer_lost
        self.on_peer_error = on_peer_error
        self._listeners: list[Listener] = []
        self._addresses: dict[int, tuple[str, ...]] = {}
        self._local_ranks: set[int] = set()
        self._out: dict[int, DataChannel] = {}
        self._connecting: dict[int, asyncio.Future[DataChannel]] = {}
        self._channels: set[DataChannel] = set()
        self._closing = False
        self.use_uds = uds.available() and os.environ.get("AIODIST_UDS", "1") != "0"
        self.use_shm = shm.available()
        self.segments = shm.SharedSegments()

    async def listen(self, host: str) -> list[str]:
        """Start listening; return the addresses to publish."""
        if self.use_uds:
            self._listeners.append(await uds.listen(host, lambda: _Link(self)))
        self._listeners.append(await tcp.listen(host, lambda: _Link(self)))
        return [lst.address for lst in self._listeners]

    def set_members(
        self, rank: int, addresses: dict[int, tuple[str, ...]], same_host: set[int]
    ) -> None:
        self.rank = rank
        self.world_size = len(addresses)
        self._addresses = addresses
        self._local_ranks = same_host
        for src, channel in list(self._out.items()):  # said hello before the table came
            if not 0 <= src < self.world_size:
                logger.warning("closing a data channel from rank %d, not a member", src)
                del self._out[src]
                channel.abort()

    def all_local(self, ranks: list[int]) -> bool:
        """True if every one of ``ranks`` (global) runs on this host."""
        return all(r == self.rank or r in self._local_ranks for r in ranks)

    # --- sending ------------------------------------------------------------------------

    async def send(self, dst: int, key: Key, meta: Any, payload: Buffer | None) -> None:
        """Send one message to global rank ``dst``; returns when ``payload`` may be reused."""
        if dst == self.rank:
            data = memoryview(bytes(payload) if payload is not None else b"")
            self._deliver_local(key, Received(dst, meta, data))
            return
        channel = self._out.get(dst) or await self._connect(dst)
        await channel.send(MessageKind.DATA, [*key, meta], payload)

    async def send_error(self, dst: int, header: Any) -> None:
        if dst != self.rank:
            channel = self._out.get(dst) or await self._connect(dst)
            await channel.send(MessageKind.PEER_ERROR, header)

    def _deliver_local(self, key: Key, msg: Received) -> None:
        posted = self.matcher.arrive(self.rank, key)
        if posted is None:
            self.matcher.buffer(self.rank, key, msg)
        else:
            self._complete(posted, msg)

    async def _connect(self, dst: int) -> DataChannel:
        pending = self._connecting.get(dst)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[DataChannel] = asyncio.get_running_loop().create_future()
        self._connecting[dst] = future
        try:
            channel = await self._open(dst)
            await channel.send(MessageKind.PEER_HELLO, [self.job, self.rank, os.getpid()])
            self._channels.add(channel)
            self._out.setdefault(dst, channel)
            future.set_result(self._out[dst])
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: the caller re-raises it
            raise
        finally:
            del self._connecting[dst]
        return self._out[dst]

    async def _open(self, dst: int) -> DataChannel:
        addresses = self._addresses.get(dst, ())
        uds_addr = [a for a in addresses if a.startswith("uds:")]
        tcp_addr = [a for a in addresses if a.startswith("tcp://")]
        if self.use_uds and dst in self._local_ranks and uds_addr:
            try:
                return await uds.connect(uds_addr[0], _Link(self, dst))
            except OSError:
                logger.debug("falling back to TCP for rank %d", dst)
        if not tcp_addr:
            raise ConnectionError(f"rank {dst} published no reachable data-plane address")
        return await tcp.connect(tcp_addr[0], _Link(self, dst))

    def _adopt(self, src: int, channel: DataChannel) -> None:
        # A peer connected to us first: use its channel for our sends to it too.
        self._channels.add(channel)
        self._out.setdefault(src, channel)

    # --- receiving ----------------------------------------------------------------------

    def recv(
        self, src: int | None, key: Key, dest: memoryview | None = None
    ) -> asyncio.Future[Received]:
        """Post a receive; the future resolves with the matched message.

        With ``dest``, a payload of the same size is written there directly; the
        returned ``Received.data`` is then ``dest`` (else a buffer holding it).
        """
        future: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        posted = _Posted(future, dest, key)
        found = self.matcher.post(src, key, posted)
        if found is not None:
            self._complete(posted, found[1])
        return future

    def _complete(self, posted: _Posted, msg: Received) -> None:
        dest = posted.dest
        if dest is not None and msg.data is not dest and dest.nbytes == msg.data.nbytes:
            dest[:] = msg.data  # it was buffered before the receive was posted
            msg = Received(msg.src, msg.meta, dest)
        if not posted.future.done():
            posted.future.set_result(msg)

    def fail(self, exc: BaseException, group_id: int | None = None) -> None:
        """Fail every posted receive (of ``group_id``, if given) with ``exc``."""
        if group_id is None:
            posted_list = self.matcher.take_all_posted()
        else:
            posted_list = self.matcher.take_posted_where(lambda k: k[1] == group_id)
        for posted in posted_list:
            if not posted.future.done():
                posted.future.set_exception(exc)

    def _channel_closed(self, link: _Link, channel: DataChannel, exc: Exception | None) -> None:
        self._channels.discard(channel)
        src = link.src
        if src is not None and self._out.get(src) is channel:
            del self._out[src]
        if self._closing or link.said_bye or src is None:
            return
        reason = f"its data connection closed ({exc or 'EOF'})"
        self.on_peer_lost(src, reason)

    async def aclose(self) -> None:
        """Say goodbye to every peer, then close channels and listeners."""
        self._closing = True
        # Goodbyes first: closing a listener may close its accepted channels too (uvloop).
        for channel in list(self._channels):
            try:
                await asyncio.wait_for(channel.send(MessageKind.PEER_BYE, []), 1.0)
            except (OSError, TimeoutError):
                pass
            channel.close()
        for listener in self._listeners:
            listener.close()
        self._channels.clear()
        self._out.clear()
        self.segments.close()
