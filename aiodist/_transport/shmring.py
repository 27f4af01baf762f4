"""Shared-memory transport for ranks on one host: large payloads through a ring of slots.

A ``ShmChannel`` is a Unix-socket channel (``uds:`` addresses, the same
listener as ``uds.py``) whose large payloads skip the socket. Each direction
that carries one gets its own *ring*: one shared segment (``shm.py``) of
``slots`` slots of ``slot_bytes``, created by the sending side on first use.
The socket stays the channel's only ordered stream and its notification path;
the frames below are the transport's own and never reach the frame sink::

    RING_HELLO [uid]                   I can receive through rings (both ends say it)
    RING_DATA  [kind, header, n, ring] frame (kind, header) whose n-byte payload comes
                                       in RING_CHUNKs; ring = [name, slots, slot_bytes]
                                       the first time, else None
    RING_CHUNK [slot, n]               the payload's next n bytes are in slot
    RING_FREE  [slot]                  (other direction) the receiver is done with slot

The sender copies chunk after chunk into free slots and the receiver copies
each out straight into the sink's memory (the destination tensor) as its
RING_CHUNK arrives, then frees the slot: two processes copy at once, each
payload byte is copied once in and once out, and nothing is copied by the
kernel. Payloads under ``min_bytes``, and every payload until the peer's
RING_HELLO came, ride the socket as usual. Where a ring cannot be made
(``/dev/shm`` missing or full) the channel keeps using the socket.

Order: a ring payload takes many loop turns to send, so sends queue behind one
lock whenever one is in progress; RING_FREE is written at once (it must not
wait behind this side's own ring send, or two ring sends in opposite
directions would wait for each other).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ProtocolError
from aiodist._transport import shm, uds
from aiodist._transport.base import start_now
from aiodist._transport.stream import DATA_LIMITS, StreamChannel
from aiodist._wire.frame import Frame, Limits, MiB, encode_frame

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aiodist._transport.base import DataChannel, FrameSink
    from aiodist._wire.frame import Buffer

__all__ = ["MIN_RING_BYTES", "ShmChannel", "ShmTransport", "connect", "listen", "scheme"]

logger = logging.getLogger(__name__)

scheme: Final = "uds"
#: Payloads of at least this many bytes go through the ring (smaller ones: the socket).
MIN_RING_BYTES: Final = 1 * MiB
SLOT_BYTES: Final = 2 * MiB
SLOTS: Final = 4
# Frame kinds of this transport, above every MessageKind (which stop below 96).
RING_HELLO: Final = 96
RING_DATA: Final = 97
RING_CHUNK: Final = 98
RING_FREE: Final = 99


class ShmChannel(StreamChannel):
    """A ``DataChannel`` over a Unix socket whose large payloads go through shared memory."""

    def __init__(
        self,
        sink: FrameSink,
        *,
        connecting: bool,
        min_bytes: int = MIN_RING_BYTES,
        slot_bytes: int = SLOT_BYTES,
        slots: int = SLOTS,
        limits: Limits = DATA_LIMITS,
    ) -> None:
        super().__init__(_RingSink(self, sink), limits)
        self._user = sink
        self._connecting = connecting
        self._min_bytes = max(1, min_bytes)
        self._slot_bytes = slot_bytes
        self._slots = slots
        self._max_payload = limits.max_payload_bytes
        self._peer_ready = False  # the peer said RING_HELLO: it can receive through rings
        self._said_hello = False
        self._usable = shm.available()
        self._queued = 0  # sends holding or waiting for the lock
        self._lock = asyncio.Lock()
        # Sending side: our ring, its free slots, and a waiter for the next free one.
        self._out: shm.Segment | None = None
        self._out_view: memoryview | None = None
        self._free: collections.deque[int] = collections.deque()
        self._slot_freed: asyncio.Future[None] | None = None
        self._close_when_free = False
        # Receiving side: the peer's ring and the ring payload in progress.
        self._in: shm.Segment | None = None
        self._in_view: memoryview | None = None
        self._in_frame: Frame | None = None
        self._in_dest: memoryview | None = None
        self._in_offset = 0
        self._in_slot_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._connecting and self._usable:
            self._say_hello()

    def _say_hello(self) -> None:
        self._said_hello = True
        self._write_control(RING_HELLO, [os.getuid()])

    def _write_control(self, kind: int, header: Any) -> None:
        transport = self._transport
        if transport is None or self._lost or transport.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} is closed")
        transport.write(encode_frame(kind, header)[0])

    # --- sending ----------------------------------------------------------------------

    def send_nowait(
        self, kind: int, header: object, payload: Buffer | None = None
    ) -> Awaitable[None] | None:
        if self._queued == 0 and (
            payload is None or not self._peer_ready or memoryview(payload).nbytes < self._min_bytes
        ):
            return self._write_frame(kind, header, payload)  # straight to the socket
        return start_now(self.send(kind, header, payload))

    async def send(self, kind: int, header: object, payload: Buffer | None = None) -> None:
        view = None if payload is None else memoryview(payload).cast("B")
        ring = view is not None and view.nbytes >= self._min_bytes and self._peer_ready
        if not ring and self._queued == 0:  # nothing ahead of it: straight to the socket
            await super().send(kind, header, payload)
            return
        self._queued += 1
        try:
            async with self._lock:
                if ring and view is not None and self._ring_ready():
                    await self._send_ring(kind, header, view)
                else:
                    await super().send(kind, header, payload)
        finally:
            self._queued -= 1

    def _ring_ready(self) -> bool:
        if self._out is not None:
            return True
        if not self._usable:
            return False
        try:
            self._out = shm.create_segment(self._slots * self._slot_bytes)
        except OSError as exc:
            self._usable = False
            logger.warning("shared memory unusable (%s); sending through the socket", exc)
            return False
        self._out_view = memoryview(self._out.memory)
        self._free.extend(range(self._slots))
        return True

    async def _send_ring(self, kind: int, header: object, view: memoryview) -> None:
        out, ring_view = self._out, self._out_view
        assert out is not None
        assert ring_view is not None
        size = self._slot_bytes
        announce = [out.name, self._slots, size] if out.linked else None
        self._write_control(RING_DATA, [kind, header, view.nbytes, announce])
        try:
            for start in range(0, view.nbytes, size):
                while not self._free:
                    self._slot_freed = asyncio.get_running_loop().create_future()
                    await asyncio.shield(self._slot_freed)
                slot = self._free.popleft()
                n = min(size, view.nbytes - start)
                ring_view[slot * size : slot * size + n] = view[start : start + n]
                self._write_control(RING_CHUNK, [slot, n])
        except asyncio.CancelledError:
            self.abort()  # half a payload is out: the stream is unusable
            raise

    def _slot_free(self, slot: Any) -> None:
        if type(slot) is not int or not 0 <= slot < self._slots or self._out is None:
            raise ProtocolError(f"RING_FREE for a slot {slot!r} that was never sent")
        self._out.unlink()  # the peer has mapped the ring: no file left to clean up
        self._free.append(slot)
        waiter = self._slot_freed
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._close_when_free and len(self._free) == self._slots:
            super().close()

    def close(self) -> None:
        # Closing with RING_FREEs still to come would leave them unread, and a Unix
        # socket closed with unread input resets the peer instead of ending cleanly.
        if self._out is not None and len(self._free) < self._slots and not self._lost:
            self._close_when_free = True
            return
        super().close()

    # --- receiving (called by _RingSink) ----------------------------------------------

    def _ring_frame(self, frame: Frame) -> None:
        kind, header = frame.kind, frame.header
        if kind == RING_HELLO:
            if header != [os.getuid()]:
                raise ProtocolError(f"RING_HELLO from another user ({header!r})")
            self._peer_ready = self._usable
            if self._usable and not self._said_hello:
                self._say_hello()
        elif kind == RING_DATA:
            self._ring_data(header)
        elif kind == RING_CHUNK:
            self._ring_chunk(header)
        elif kind == RING_FREE:
            self._slot_free(header[0] if isinstance(header, list) and header else None)

    def _ring_data(self, header: Any) -> None:
        if not isinstance(header, list) or len(header) != 4 or self._in_frame is not None:
            raise ProtocolError("malformed or unexpected RING_DATA")
        kind, inner, nbytes, announce = header
        if type(nbytes) is not int or not 0 < nbytes <= self._max_payload:
            raise ProtocolError(f"ring payload of {nbytes!r} bytes is out of bounds")
        if announce is not None and not (self._in is not None and self._in.name == announce[0]):
            # Every payload announces the ring until the sender learns it is mapped (a
            # RING_FREE) and unlinks its file: a later announcement of the ring already
            # mapped here keeps that mapping; the file may be gone by now.
            name, slots, slot_bytes = announce
            self._close_in()
            try:
                self._in = shm.map_segment(name, slots * slot_bytes)
            except (OSError, ValueError) as exc:
                raise ProtocolError(f"cannot map the peer's ring: {exc}") from exc
            self._in_view = memoryview(self._in.memory)
            self._in_slot_bytes = slot_bytes
        if self._in is None:
            raise ProtocolError("RING_DATA before any ring was announced")
        frame = Frame(kind, inner, nbytes)
        dest = self._user.frame_received(self, frame)
        if dest is None or dest.nbytes != nbytes:
            raise ProtocolError("frame sink gave no buffer of the payload's size")
        self._in_frame, self._in_dest, self._in_offset = frame, dest, 0

    def _ring_chunk(self, header: Any) -> None:
        frame, dest, ring = self._in_frame, self._in_dest, self._in_view
        if frame is None or dest is None or ring is None or not isinstance(header, list):
            raise ProtocolError("RING_CHUNK outside a ring payload")
        slot, n = header
        start, offset = slot * self._in_slot_bytes, self._in_offset
        if not (0 <= start and start + n <= ring.nbytes and 0 < n <= dest.nbytes - offset):
            raise ProtocolError(f"RING_CHUNK [{slot}, {n}] out of bounds")
        dest[offset : offset + n] = ring[start : start + n]
        self._write_control(RING_FREE, [slot])
        self._in_offset = offset + n
        if self._in_offset == dest.nbytes:
            self._in_frame = self._in_dest = None
            self._user.payload_received(self, frame)

    def _ring_closed(self, exc: Exception | None) -> Exception | None:
        if exc is None and self._in_frame is not None:
            exc = ProtocolError(f"peer {self.peer} closed the connection in the middle of a frame")
        waiter = self._slot_freed
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError(f"connection to {self.peer} was lost"))
        self._close_in()
        if self._out is not None:
            if self._out_view is not None:
                self._out_view.release()
            self._out.close()
            self._out = self._out_view = None
        return exc

    def _close_in(self) -> None:
        if self._in_view is not None:
            self._in_view.release()
        if self._in is not None:
            self._in.close()
        self._in = self._in_view = None


class _RingSink:
    """Sits between the stream and the data plane's sink: takes the ring's own frames."""

    def __init__(self, channel: ShmChannel, user: FrameSink) -> None:
        self.channel = channel
        self.user = user

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        if frame.kind < RING_HELLO:
            return self.user.frame_received(self.channel, frame)
        self.channel._ring_frame(frame)
        return None

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        if frame.kind < RING_HELLO:
            self.user.payload_received(self.channel, frame)

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        self.user.channel_closed(self.channel, self.channel._ring_closed(exc))


class ShmTransport:
    """The ``Transport`` of ``ShmChannel``s, with its ring's sizes."""

    scheme: Final = scheme

    def __init__(
        self, *, min_bytes: int = MIN_RING_BYTES, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS
    ) -> None:
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"need slots >= 1 of >= 1 byte, got {slots} of {slot_bytes}")
        self.min_bytes, self.slot_bytes, self.slots = min_bytes, slot_bytes, slots

    def _channel(self, sink: FrameSink, connecting: bool) -> ShmChannel:
        return ShmChannel(
            sink,
            connecting=connecting,
            min_bytes=self.min_bytes,
            slot_bytes=self.slot_bytes,
            slots=self.slots,
        )

    async def listen(self, host: str, sink_factory: Callable[[], FrameSink]) -> uds.UdsListener:
        """Listen on a fresh abstract Unix socket; plain ``uds`` peers may connect too."""
        return await uds.listen(host, sink_factory, lambda sink: self._channel(sink, False))

    async def connect(self, address: str, sink: FrameSink) -> ShmChannel:
        """Connect to a ``uds:`` address of a rank on this host that listens with rings."""
        channel = await uds.connect(address, sink, lambda s: self._channel(s, True))
        assert isinstance(channel, ShmChannel)
        return channel


_default = ShmTransport()
listen = _default.listen
connect = _default.connect
