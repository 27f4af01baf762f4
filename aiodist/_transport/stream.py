"""``asyncio.BufferedProtocol`` glue shared by stream transports (TCP, Unix sockets).

Receiving: headers land in a scratch buffer and go through ``FrameDecoder``;
once a frame's header names its payload, ``get_buffer`` hands the event loop
the destination's own memory (a tensor's, for a matched receive), so large
payloads are read straight into place with no intermediate copy.

Before the handshake (until the data plane calls ``handshake_done``), a
channel reads through a small scratch buffer, decodes under
``PREAUTH_FRAME_LIMITS`` (a small header, no payload), and on the accepting
side is charged to its listener's ``Admission`` (a byte budget, a deadline,
a cap that sheds the oldest). A refusal then closes that one connection and
is logged within the listener's budget; after the handshake a protocol error
is one warning line.

Sending: the payload is written as memoryview slices of about 1 MiB (one huge
write is slow on the default loop). The write buffer's high-water mark is 0,
so the transport pauses us whenever anything is left unsent and resumes us
once it is all in the kernel: ``send`` returns exactly when the caller may
reuse the payload's memory.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import TYPE_CHECKING, Final, cast

from aiodist._errors import ProtocolError
from aiodist._wire.frame import (
    NEED_DATA,
    Frame,
    FrameDecoder,
    KiB,
    Limits,
    MiB,
    encode_frame,
)
from aiodist._wire.preauth import PREAUTH_FRAME_LIMITS

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from aiodist._transport.admission import Admission
    from aiodist._transport.base import FrameSink
    from aiodist._wire.frame import Buffer

logger = logging.getLogger(__name__)

SCRATCH_BYTES: Final = 256 * KiB
# Reads before the handshake: a hello and a proof are a few hundred bytes (and a peer's
# first messages may follow them in the same read, so this stays under the byte budget).
PREAUTH_SCRATCH_BYTES: Final = 8 * KiB
WRITE_SLICE_BYTES: Final = 1 * MiB
COALESCE_BYTES: Final = 64 * KiB  # smaller payloads go out in one write with their header
DATA_LIMITS: Final = Limits(max_header_bytes=16 * MiB)


_UCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _unix_peer(transport: asyncio.BaseTransport) -> str:
    """The process at the other end of a Unix socket, as the kernel says (``SO_PEERCRED``)."""
    try:
        sock = transport.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        pid, uid, _ = _UCRED.unpack(raw)
    except (AttributeError, OSError, struct.error):  # not Linux, or the socket is gone
        return "a Unix socket"
    return f"pid {pid} (uid {uid})"


class StreamChannel(asyncio.BufferedProtocol):
    """A ``DataChannel`` over a byte stream.

    ``admission`` is the listener's, for an accepted connection (None: this side
    connected).
    """

    def __init__(
        self,
        sink: FrameSink,
        admission: Admission | None = None,
        *,
        limits: Limits = DATA_LIMITS,
    ) -> None:
        self._sink = sink
        self._admission = admission
        self._limits = limits
        self._proved = False  # handshake_done() came: the limits above apply
        self._decoder = FrameDecoder(PREAUTH_FRAME_LIMITS)
        self._scratch = memoryview(bytearray(PREAUTH_SCRATCH_BYTES))
        self._frame: Frame | None = None
        self._dest: memoryview | None = None
        self._dest_offset = 0
        self._transport: asyncio.Transport | None = None
        self._writable: asyncio.Future[None] | None = None
        self._closed_exc: Exception | None = None
        self._lost = False
        self.peer = "?"

    # --- asyncio.BufferedProtocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast("asyncio.Transport", transport)
        self._transport.set_write_buffer_limits(high=0, low=0)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
        else:  # a Unix socket: an accepted one has no name, but the kernel knows its process
            self.peer = (peer and repr(peer)) or _unix_peer(transport)
        if self._admission is not None:
            self._admission.enter(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dest is not None and not self._decoder.buffered_nbytes:
            return self._dest[self._dest_offset :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed_exc is not None or self._lost:
            return  # refused already: nothing more of it is read
        try:
            if self._dest is not None and not self._decoder.buffered_nbytes:
                self._decoder.consume_payload(nbytes)
                self._dest_offset += nbytes
                if not self._decoder.payload_remaining:
                    self._payload_done()
                return
            admission = self._admission
            if not self._proved and admission is not None and not admission.charge(self, nbytes):
                return  # over its budget: refused, and nothing of it is read
            self._decoder.receive_data(self._scratch[:nbytes])
            self._process()
        except ProtocolError as exc:
            self._fail(exc)
        except Exception as exc:  # mid-frame state is unknown: drop the connection
            if self._proved or self._admission is None:  # else logged within the budget
                logger.exception("data channel from %s failed", self.peer)
            self._fail(exc)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._admission is not None:
            self._admission.left(self)
        if (
            self._closed_exc is None
            and exc is None
            and (self._frame is not None or self._decoder.buffered_nbytes)
        ):
            exc = ProtocolError(f"peer {self.peer} closed the connection in the middle of a frame")
        closed_exc, self._closed_exc = self._closed_exc or exc, None
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError(f"connection to {self.peer} was lost"))
        # Drop what the connection held (buffered bytes, the destination, the error and
        # its traceback, which refers back to this channel): a closed channel is freed
        # when its last reference goes, not at the next full garbage collection.
        self._decoder = FrameDecoder(PREAUTH_FRAME_LIMITS)
        self._scratch = memoryview(b"")
        self._frame = self._dest = None
        self._channel_closed(closed_exc)

    # --- the handshake (DataChannel) ---------------------------------------------------

    def handshake_done(self) -> None:
        """The peer proved itself: lift the pre-handshake limits (again is fine)."""
        if self._proved:
            return
        self._proved = True
        self._decoder.limits = self._limits  # from the next frame on
        if not self._lost:
            # The decoder copied what was read: the old scratch may go even mid-read.
            self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        if self._admission is not None:
            self._admission.passed(self)

    def refuse(self, exc: ProtocolError) -> None:
        """Close at once for ``exc`` (the admission's: a deadline, a budget, shedding)."""
        self._closed_exc = self._closed_exc or exc
        if self._transport is not None:
            self._transport.abort()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # --- receiving --------------------------------------------------------------------

    def _process(self) -> None:
        dec = self._decoder
        if self._dest is not None:  # the rest of a payload that began in an earlier read
            self._take_payload()
        while dec.buffered_nbytes:
            event = dec.next_event()
            if event is NEED_DATA:  # a frame's start, not yet whole
                return
            assert isinstance(event, Frame)  # no payload is pending, and EOF is not fed here
            if not self._proved and self._admission is not None:
                self._admission.spoke(self)  # a peer that speaks is shed after silent ones
            self._frame = event
            dest = self._frame_received(event)
            nbytes = event.payload_nbytes
            if nbytes:
                if dest is None or dest.nbytes != nbytes:
                    raise ProtocolError("frame sink gave no buffer of the payload's size")
                # A small payload came with this read: taken here, at once. The rest of a
                # larger one comes in later reads, straight into ``dest`` (``get_buffer``).
                taken = dec.take_payload(dest)
                if taken < nbytes:  # every buffered byte was taken: nothing else to decode
                    self._dest, self._dest_offset = dest, taken
                    return
            self._payload_done()

    def _take_payload(self) -> None:
        # The payload bytes that came with this read, copied straight into place.
        dest = self._dest
        assert dest is not None
        self._dest_offset += self._decoder.take_payload(dest[self._dest_offset :])
        if not self._decoder.payload_remaining:
            self._payload_done()

    def _payload_done(self) -> None:
        frame, self._frame, self._dest = self._frame, None, None
        assert frame is not None
        self._payload_received(frame)

    # What arrived, handed on: a subclass takes its own frames here (shmring's rings).

    def _frame_received(self, frame: Frame) -> memoryview | None:
        return self._sink.frame_received(self, frame)

    def _payload_received(self, frame: Frame) -> None:
        self._sink.payload_received(self, frame)

    def _channel_closed(self, exc: Exception | None) -> None:
        self._sink.channel_closed(self, exc)

    def _fail(self, exc: Exception) -> None:
        if self._closed_exc is not None:
            return  # refused already; this is what followed
        self._closed_exc = exc
        if not self._proved and self._admission is not None:
            self._admission.protocol_error(self, exc)  # logged within the listener's budget
        elif isinstance(exc, ProtocolError):
            # As a string: a record kept by a handler must not keep the error's traceback.
            logger.warning("closing the data channel from %s: %s", self.peer, str(exc))
        if self._transport is not None:
            self._transport.abort()

    # --- sending ----------------------------------------------------------------------

    async def send(self, kind: int, header: object, payload: Buffer | None = None) -> None:
        rest = self._write_frame(kind, header, payload)
        if rest is not None:
            await rest

    def send_nowait(
        self, kind: int, header: object, payload: Buffer | None = None
    ) -> Awaitable[None] | None:
        return self._write_frame(kind, header, payload)

    def _write_frame(
        self, kind: int, header: object, payload: Buffer | None
    ) -> Awaitable[None] | None:
        # Both sends' body, never overridden: a subclass's send may call this one's.
        transport = self._transport
        if transport is None or self._lost or transport.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} is closed")
        parts = encode_frame(kind, header, payload, join_bytes=COALESCE_BYTES)
        transport.write(parts[0])
        if len(parts) > 1:  # a large payload (or header), in slices
            for part in parts[1:]:
                view = memoryview(part).cast("B")
                for start in range(0, view.nbytes, WRITE_SLICE_BYTES):
                    transport.write(view[start : start + WRITE_SLICE_BYTES])
        writable = self._writable
        if writable is not None and not writable.done():
            return self._drained(writable)  # the kernel took part of it: wait for the rest
        return None

    async def _drained(self, writable: asyncio.Future[None]) -> None:
        try:
            await asyncio.shield(writable)
        except asyncio.CancelledError:
            self.abort()  # a frame may be half-written: the stream is unusable
            raise

    def close(self) -> None:
        if self._admission is not None:
            self._admission.forget(self)
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._admission is not None:
            self._admission.forget(self)
        if self._transport is not None:
            self._transport.abort()
