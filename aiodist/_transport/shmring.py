"""Shared-memory transport for ranks on one host: large payloads through a ring of slots.

A ``ShmChannel`` is a Unix-socket channel (``uds:`` addresses, the same
listener as ``uds.py``) whose large payloads skip the socket. Each direction
that carries one gets its own *ring*: one shared segment (``shm.py``) of
``slots`` slots of ``slot_bytes``, created by the sending side on first use.
The socket stays the channel's only ordered stream and its notification path;
the frames of ``ringwire.py`` (RING_HELLO, RING_DATA, RING_CHUNK, RING_FREE)
are the transport's own and never reach the frame sink.

None of them is read before the data plane's handshake is done (see
``base.py``): one that comes earlier closes the connection, so a stranger on
the host, who can connect to any rank's Unix socket, makes no rank map or
allocate anything. The connecting side says RING_HELLO once its side of the
handshake is done, which puts it after the handshake on the wire too. Every
field that comes from the peer is checked (``ringwire``; a segment must be
this user's regular file, ``shm.map_segment``) before it is used: a bad one
is a ``ProtocolError`` that closes the connection, never an error of this
process.

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
from aiodist._transport.ringwire import (
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    RING_CHUNK,
    RING_DATA,
    RING_FREE,
    RING_HELLO,
    Ring,
    parse_ring_chunk,
    parse_ring_data,
    parse_ring_free,
)
from aiodist._transport.stream import DATA_LIMITS, StreamChannel
from aiodist._wire.frame import Frame, Limits, MiB, encode_frame

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aiodist._transport.admission import Admission, SocketListener
    from aiodist._transport.base import FrameSink
    from aiodist._wire.frame import Buffer
    from aiodist._wire.preauth import PreAuthLimits

logger = logging.getLogger(__name__)

scheme: Final = "uds"
#: Payloads of at least this many bytes go through the ring (smaller ones: the socket).
MIN_RING_BYTES: Final = 1 * MiB
SLOT_BYTES: Final = 2 * MiB
SLOTS: Final = 4


class ShmChannel(StreamChannel):
    """A ``DataChannel`` over a Unix socket whose large payloads go through shared memory."""

    def __init__(
        self,
        sink: FrameSink,
        admission: Admission | None = None,
        *,
        connecting: bool,
        min_bytes: int = MIN_RING_BYTES,
        slot_bytes: int = SLOT_BYTES,
        slots: int = SLOTS,
        limits: Limits = DATA_LIMITS,
    ) -> None:
        super().__init__(sink, admission, limits=limits)
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
        self._in_ring: Ring | None = None
        self._in_view: memoryview | None = None
        self._in_frame: Frame | None = None
        self._in_dest: memoryview | None = None
        self._in_offset = 0

    def handshake_done(self) -> None:
        first = not self._proved
        super().handshake_done()
        # The connecting side offers rings now: right after its last handshake frame.
        transport = self._transport
        if (
            first
            and self._connecting
            and self._usable
            and transport is not None
            and not self._lost
            and not transport.is_closing()
        ):
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

    def _slot_free(self, header: Any) -> None:
        slot = parse_ring_free(header, self._slots)
        if self._out is None or slot in self._free:  # freed twice, it would carry two chunks
            raise ProtocolError(f"RING_FREE for slot {slot}, which holds nothing sent")
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

    # --- receiving ----------------------------------------------------------------------

    def _frame_received(self, frame: Frame) -> memoryview | None:
        if frame.kind < RING_HELLO:
            return self._sink.frame_received(self, frame)
        self._ring_frame(frame)
        return None

    def _payload_received(self, frame: Frame) -> None:
        if frame.kind < RING_HELLO:
            self._sink.payload_received(self, frame)

    def _channel_closed(self, exc: Exception | None) -> None:
        self._sink.channel_closed(self, self._ring_closed(exc))

    def _ring_frame(self, frame: Frame) -> None:
        kind, header = frame.kind, frame.header
        if not self._proved:
            raise ProtocolError(f"a shared-memory frame (kind {kind}) before the handshake")
        if kind == RING_HELLO:
            if header != [os.getuid()]:
                raise ProtocolError("RING_HELLO from another user")
            self._peer_ready = self._usable
            if self._usable and not self._said_hello:
                self._say_hello()
        elif kind == RING_DATA:
            self._ring_data(header)
        elif kind == RING_CHUNK:
            self._ring_chunk(header)
        elif kind == RING_FREE:
            self._slot_free(header)
        else:
            raise ProtocolError(f"unexpected frame kind {kind} on a data channel")

    def _ring_data(self, header: Any) -> None:
        if self._in_frame is not None:
            raise ProtocolError("RING_DATA in the middle of another ring payload")
        data = parse_ring_data(header, self._max_payload)
        ring = data.ring
        # Every payload announces the ring until the sender learns it is mapped (a
        # RING_FREE) and unlinks its file: a later announcement of the ring already
        # mapped here keeps that mapping; the file may be gone by now.
        if ring is not None and (self._in_ring is None or self._in_ring.name != ring.name):
            self._close_in()
            try:
                self._in = shm.map_segment(ring.name, ring.slots * ring.slot_bytes)
            except (OSError, ValueError) as exc:
                raise ProtocolError(f"cannot map the peer's ring: {exc}") from None
            self._in_view = memoryview(self._in.memory)
            self._in_ring = ring
        if self._in_ring is None:
            raise ProtocolError("RING_DATA before any ring was announced")
        frame = Frame(data.kind, data.header, data.nbytes)
        dest = self._sink.frame_received(self, frame)
        if dest is None or dest.nbytes != data.nbytes:
            raise ProtocolError("frame sink gave no buffer of the payload's size")
        self._in_frame, self._in_dest, self._in_offset = frame, dest, 0

    def _ring_chunk(self, header: Any) -> None:
        frame, dest, ring, view = self._in_frame, self._in_dest, self._in_ring, self._in_view
        if frame is None or dest is None or ring is None or view is None:
            raise ProtocolError("RING_CHUNK outside a ring payload")
        offset = self._in_offset
        slot, n = parse_ring_chunk(header, ring, room=dest.nbytes - offset)
        start = slot * ring.slot_bytes
        dest[offset : offset + n] = view[start : start + n]
        self._write_control(RING_FREE, [slot])
        self._in_offset = offset + n
        if self._in_offset == dest.nbytes:
            self._in_frame = self._in_dest = None
            self._sink.payload_received(self, frame)

    def _ring_closed(self, exc: Exception | None) -> Exception | None:
        if exc is None and self._in_frame is not None:
            exc = ProtocolError(f"peer {self.peer} closed the connection in the middle of a frame")
        self._in_frame = self._in_dest = None
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
        self._in = self._in_view = self._in_ring = None


class ShmTransport:
    """The ``Transport`` of ``ShmChannel``s, with its ring's sizes."""

    scheme: Final = scheme

    def __init__(
        self, *, min_bytes: int = MIN_RING_BYTES, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS
    ) -> None:
        if not (1 <= slot_bytes <= MAX_SLOT_BYTES and 1 <= slots <= MAX_SLOTS):
            raise ValueError(
                f"need 1 to {MAX_SLOTS} slots of 1 to {MAX_SLOT_BYTES} bytes (what peers "
                f"accept), got {slots} of {slot_bytes}"
            )
        self.min_bytes, self.slot_bytes, self.slots = min_bytes, slot_bytes, slots

    def _channel(self, sink: FrameSink, admission: Admission | None) -> ShmChannel:
        return ShmChannel(
            sink,
            admission,
            connecting=admission is None,  # an accepted channel has its listener's admission
            min_bytes=self.min_bytes,
            slot_bytes=self.slot_bytes,
            slots=self.slots,
        )

    async def listen(
        self,
        host: str,
        sink_factory: Callable[[], FrameSink],
        *,
        preauth: PreAuthLimits | None = None,
    ) -> SocketListener:
        """Listen on a fresh abstract Unix socket; plain ``uds`` peers may connect too."""
        return await uds.listen(host, sink_factory, self._channel, preauth=preauth)

    async def connect(self, address: str, sink: FrameSink) -> ShmChannel:
        """Connect to a ``uds:`` address of a rank on this host that listens with rings."""
        channel = await uds.connect(address, sink, self._channel)
        assert isinstance(channel, ShmChannel)
        return channel


_default = ShmTransport()
listen = _default.listen
connect = _default.connect
