"""A data-plane transport of your own: TCP over asyncio streams, each frame checksummed.

Run it with ``aiodist run -n 4 examples/crc_transport.py``: every rank
registers the transport as ``crc``, the job picks it (``AIODIST_TRANSPORT``,
set here unless you set it yourself), and the ranks' collectives and messages
travel over ``crc://`` channels. Any script that registers it may use it the
same way: ``AIODIST_TRANSPORT=crc aiodist run -n 4 train.py``.

aiodist's own transports read payloads straight into tensor memory
(``asyncio.BufferedProtocol``). This one shows the interface
(``aiodist.transport``) with the plainest tools, and adds what some links
need: a reader task per connection on asyncio streams, and a CRC32 on every
frame, so corruption in transit (a NIC without checksum offload, a flaky
tunnel) is caught and the connection closed rather than a wrong tensor
delivered. On the wire, each frame is::

    u64 length | u32 crc32 of the rest | aiodist frame (encode_frame's bytes)

It passes ``aiodist.testing.check_data_channel(CrcTransport())``, limits
before the handshake included (it uses ``Admission`` for them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import zlib
from typing import TYPE_CHECKING, Final

import anyio
import torch

import aiodist
from aiodist.transport import (
    PREAUTH_FRAME_LIMITS,
    PREFIX,
    Admission,
    Frame,
    FrameDecoder,
    Limits,
    encode_frame,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aiodist.transport import FrameSink, PreAuthLimits

    Buffer = bytes | bytearray | memoryview

logger = logging.getLogger(__name__)

SCHEME: Final = "crc"
HEAD: Final = struct.Struct("!QI")  # the frame's length, then its CRC32
LIMITS: Final = Limits(max_header_bytes=16 * 1024 * 1024)  # after the handshake
HIGH_WATER: Final = 4 * 1024 * 1024  # buffered bytes beyond which a send waits


class CrcChannel:
    """A ``DataChannel``: frames with a length and a CRC32, over one TCP stream."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        sink: FrameSink,
        admission: Admission | None = None,
    ) -> None:
        self._reader, self._writer, self._sink = reader, writer, sink
        self._admission = admission  # the listener's, on an accepted channel
        self._limits = PREAUTH_FRAME_LIMITS  # until handshake_done
        self._closed_exc: Exception | None = None
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        self.frames_checked = 0
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if admission is not None:
            admission.enter(self)  # may refuse it at once (too many strangers waiting)

    # --- DataChannel ----------------------------------------------------------------------

    async def send(self, kind: int, header: object, payload: Buffer | None = None) -> None:
        rest = self.send_nowait(kind, header, payload)
        if rest is not None:
            await rest

    def send_nowait(
        self, kind: int, header: object, payload: Buffer | None = None
    ) -> Awaitable[None] | None:
        if self._writer.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} is closed")
        body = b"".join(encode_frame(kind, header, payload))  # a copy: the payload is free now
        self._writer.writelines([HEAD.pack(len(body), zlib.crc32(body)), body])  # one frame, whole
        if self._writer.transport.get_write_buffer_size() > HIGH_WATER:
            return self._writer.drain()  # let the kernel catch up before sending more
        return None

    def handshake_done(self) -> None:
        if self._limits is not LIMITS:
            self._limits = LIMITS
            if self._admission is not None:
                self._admission.passed(self)

    def close(self) -> None:
        if self._admission is not None:
            self._admission.forget(self)
        self._writer.close()  # what was written is still sent

    def abort(self) -> None:
        if self._admission is not None:
            self._admission.forget(self)
        self._writer.transport.abort()

    def refuse(self, exc: Exception) -> None:
        """The admission gave up on it (budget, deadline, shed): close, saying why."""
        self._closed_exc = self._closed_exc or exc
        self._writer.transport.abort()

    # --- receiving ------------------------------------------------------------------------

    async def read_frames(self) -> None:
        """Hand every frame to the sink until the stream ends; then say how it ended."""
        exc: Exception | None = None
        try:
            while await self._read_frame():
                pass
        except OSError as error:  # the connection broke under it
            exc = error
        except Exception as error:  # a protocol error, or a sink's: its state is unknown
            exc = error
            if self._closed_exc is None and self._limits is not LIMITS and self._admission:
                self._admission.protocol_error(self, exc)  # logged within its budget
            elif self._closed_exc is None:
                logger.warning("closing the crc channel from %s: %s", self.peer, exc)
        finally:
            if self._admission is not None:
                self._admission.left(self)
            if exc is None and self._closed_exc is None:
                self._writer.close()  # a clean end: close our side too
            else:
                self._writer.transport.abort()
            self._sink.channel_closed(self, self._closed_exc or exc)

    async def _read_frame(self) -> bool:
        try:
            head = await self._reader.readexactly(HEAD.size)
        except asyncio.IncompleteReadError as eof:
            if eof.partial:
                raise aiodist.ProtocolError(
                    f"{self.peer} closed in the middle of a frame"
                ) from None
            return False  # a clean end, between frames
        n, crc = HEAD.unpack(head)
        limits = self._limits
        most = PREFIX.size + limits.max_header_bytes + limits.max_payload_bytes
        if n > most:  # checked before a byte of it is read, let alone stored
            raise aiodist.ProtocolError(f"a frame of {n} bytes exceeds the limit of {most}")
        if self._admission is not None and limits is not LIMITS:
            if not self._admission.charge(self, HEAD.size + n):
                return False  # over its budget before the handshake: refused already
        try:
            body = memoryview(await self._reader.readexactly(n))
        except asyncio.IncompleteReadError as eof:
            raise aiodist.ProtocolError(f"{self.peer} closed in the middle of a frame") from eof
        if zlib.crc32(body) != crc:
            raise aiodist.ProtocolError(f"a frame from {self.peer} failed its CRC32: corrupted")
        self.frames_checked += 1
        header_end = PREFIX.size + PREFIX.unpack_from(body)[3]
        decoder = FrameDecoder(limits)  # checks the prefix and header against the limits
        decoder.receive_data(body[:header_end])
        frame = decoder.next_event()
        if not isinstance(frame, Frame) or header_end + frame.payload_nbytes != n:
            raise aiodist.ProtocolError(f"a frame from {self.peer} is not what its length says")
        if self._admission is not None and limits is not LIMITS:
            self._admission.spoke(self)  # a peer that speaks is shed after silent ones
        self._deliver(frame, body[header_end:])
        return True

    def _deliver(self, frame: Frame, payload: memoryview) -> None:
        dest = self._sink.frame_received(self, frame)
        if frame.payload_nbytes:
            if dest is None or dest.nbytes != frame.payload_nbytes:
                raise aiodist.ProtocolError("the sink gave no buffer of the payload's size")
            dest[:] = payload
        self._sink.payload_received(self, frame)


class CrcListener:
    """A listening ``crc://HOST:PORT``; closing it refuses the connections not yet proved."""

    def __init__(self, server: asyncio.Server, address: str, admission: Admission) -> None:
        self.server, self.address, self.admission = server, address, admission

    def close(self) -> None:
        self.server.close()
        self.admission.close()


class CrcTransport:
    """The ``Transport``: ``crc://`` addresses, a ``CrcChannel`` per connection."""

    scheme = SCHEME

    def __init__(self) -> None:
        self.channels: list[CrcChannel] = []  # every channel made here (the demo counts them)

    async def listen(
        self,
        host: str,
        sink_factory: Callable[[], FrameSink],
        *,
        preauth: PreAuthLimits | None = None,
    ) -> CrcListener:
        admission = Admission(preauth)

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            channel = CrcChannel(reader, writer, sink_factory(), admission)
            self.channels.append(channel)
            await channel.read_frames()  # this task is the connection's reader

        server = await asyncio.start_server(accepted, host, 0)
        bound, port = server.sockets[0].getsockname()[:2]
        return CrcListener(server, f"{SCHEME}://{bound}:{port}", admission)

    async def connect(self, address: str, sink: FrameSink) -> CrcChannel:
        host, _, port = address.removeprefix(f"{SCHEME}://").rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        channel = CrcChannel(reader, writer, sink)
        self.channels.append(channel)
        reading = asyncio.ensure_future(channel.read_frames())
        _readers.add(reading)  # held until it ends (the loop keeps tasks weakly)
        reading.add_done_callback(_readers.discard)
        return channel


_readers: set[asyncio.Future[None]] = set()
transport = CrcTransport()


async def main() -> None:
    aiodist.register_transport("crc", transport)
    os.environ.setdefault("AIODIST_TRANSPORT", "crc")  # this job's channels: crc ones
    await aiodist.init_process_group()
    rank, n = aiodist.get_dist_info()

    t = torch.full((1 << 20,), float(rank + 1))  # 4 MiB
    await aiodist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2)), "all_reduce"
    got = await aiodist.all_gather_object({"rank": rank})
    assert got == [{"rank": r} for r in range(n)], "all_gather_object"
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    back = torch.empty(1 << 20)
    receiving = aiodist.irecv(back, prev)
    await aiodist.isend(torch.full((1 << 20,), float(rank)), nxt)
    await receiving
    assert torch.equal(back, torch.full_like(back, float(prev))), "isend/irecv"

    await aiodist.barrier()
    checked = sum(c.frames_checked for c in transport.channels)
    print(
        f"crc transport: all_reduce, all_gather_object and isend/irecv of 4 MiB over "
        f"{len(transport.channels)} crc channels, {checked} frames checked",
        flush=True,
    )
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
