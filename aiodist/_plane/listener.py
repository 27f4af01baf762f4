"""The Unix-socket listener that every data plane of one process shares.

Each plane that listens on it gets a member number and publishes
``uds:NAME#MEMBER``; a peer's ``PeerHello`` names the member it wants, and the
channel's frames go to a ``ChannelState`` of that plane from then on (``_Router``). A
process of many ranks then holds one listening socket, not one per rank. The
listener closes with its last plane; a plane that listens later opens a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from typing import TYPE_CHECKING, Final

from aiodist._errors import ProtocolError
from aiodist._plane.channel import ChannelState
from aiodist._transport import shmring, uds
from aiodist._wire.frame import frame_message
from aiodist._wire.messages import PeerHello
from aiodist._wire.preauth import PreAuthLimits, open_files_limit

if TYPE_CHECKING:
    from aiodist._plane.core import PlaneCore
    from aiodist._transport.base import DataChannel, Listener
    from aiodist._wire.frame import Frame

#: Seconds from accept to a finished handshake on a data-plane listener (a real peer's
#: takes milliseconds; a plane with a token answers a hello once it has its own rank).
#: Read when a listener opens: a test may lower it first.
HANDSHAKE_DEADLINE = 10.0
# Unproved connections one listener keeps at most: an eighth of the process's file
# descriptors, between PreAuthLimits' default and this.
_MAX_PENDING: Final = 1024


def preauth_limits() -> PreAuthLimits:
    """What a connection may cost a data-plane listener of this process before its handshake."""
    return PreAuthLimits.for_open_files(
        open_files_limit(), share=8, most=_MAX_PENDING, deadline=HANDSHAKE_DEADLINE
    )


class SharedListener:
    """The Unix-socket listener of every data plane of this process (one loop, one kind).

    Each plane that listens gets a member number and publishes ``uds:NAME#MEMBER``;
    an accepted channel belongs to the plane its hello names. A process of many
    ranks then holds one listening socket, not one per rank.
    """

    def __init__(self) -> None:
        self.listener: Listener | None = None
        self.planes: dict[int, PlaneCore] = {}
        self._members = itertools.count(1)
        self.closed = False

    def add(self, plane: PlaneCore) -> tuple[int, str]:
        assert self.listener is not None
        assert not self.closed
        member = next(self._members)
        self.planes[member] = plane
        return member, f"{self.listener.address}#{member}"

    def remove(self, member: int) -> None:
        self.planes.pop(member, None)
        if not self.planes and self.listener is not None:
            self.closed = True  # a plane that listens later opens a new one
            self.listener.close()
            _forget(self)


# Per event loop: the shared listener with rings (True) or plain (False), or its start.
_shared_listeners: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[bool, asyncio.Future[SharedListener]]
] = weakref.WeakKeyDictionary()


async def shared_listener(rings: bool) -> SharedListener:
    loop = asyncio.get_running_loop()
    table = _shared_listeners.setdefault(loop, {})
    while True:
        future = table.get(rings)
        if future is None or (
            future.done() and (future.exception() is not None or future.result().closed)
        ):
            future = table[rings] = asyncio.ensure_future(_start(rings))
        shared = await asyncio.shield(future)
        if not shared.closed:  # it may have closed while we waited: start another
            return shared


def _forget(shared: SharedListener) -> None:
    # The table's futures hold the listener, whose server holds its loop: left in the
    # table, the loop (its key, held weakly) would never be freed.
    for loop, table in list(_shared_listeners.items()):
        for rings, future in list(table.items()):
            if (
                future.done()
                and not future.cancelled()
                and future.exception() is None
                and future.result() is shared
            ):
                del table[rings]
        if not table:
            del _shared_listeners[loop]


async def _start(rings: bool) -> SharedListener:
    shared = SharedListener()
    transport = shmring if rings else uds
    shared.listener = await transport.listen("", lambda: _Router(shared), preauth=preauth_limits())
    return shared


class _Router:
    """The frame sink of a channel accepted on the shared listener, until its hello.

    The hello names the member (plane) the peer wants; from then on the frames go
    to that plane's ``ChannelState``.
    """

    __slots__ = ("_link", "_shared")

    def __init__(self, shared: SharedListener) -> None:
        self._shared = shared
        self._link: ChannelState | None = None

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        link = self._link
        if link is None:
            if frame.kind != PeerHello.KIND:
                raise ProtocolError("a data channel must open with PeerHello naming a member")
            hello = frame_message(frame)
            plane = self._shared.planes.get(hello.member)
            if plane is None:
                raise ProtocolError(
                    f"no member {hello.member} listens here (it left, or never was)"
                )
            link = self._link = ChannelState(plane)
            link.hello(channel, hello)
            return None
        return link.frame_received(channel, frame)

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        assert self._link is not None  # a payload follows a frame, which made the link
        self._link.payload_received(channel, frame)

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        if self._link is not None:
            self._link.channel_closed(channel, exc)
