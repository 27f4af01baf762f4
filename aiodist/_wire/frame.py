"""Framing: the binary prefix, ``encode_frame`` and the incremental ``FrameDecoder``.

Every frame on every aiodist connection, control plane and data plane alike:

    offset  size  field
    0       2     magic          b"AD"
    2       1     version        PROTOCOL_VERSION; a peer speaking another one is refused
    3       1     kind           the message's kind (``messages.py``)
    4       4     header_nbytes  length of the msgpack header (unsigned, big-endian)
    8       8     payload_nbytes length of the raw payload that follows the header

    16      header_nbytes   msgpack header: an array of the message's fields
    ...     payload_nbytes  raw bytes (tensor memory, an encoded object), never re-encoded

Rules the decoder keeps:

- Limits are checked on the prefix, *before* any header or payload byte is
  buffered: a peer announcing a 1 TiB payload is refused at byte 16.
- Any violation (bad magic, version, limits, undecodable header, EOF inside a
  frame) raises ``ProtocolError`` naming the value and the limit. The decoder
  is then poisoned; the I/O layer closes that one connection.
- The payload is handed out as ``PayloadChunk`` events from whatever was
  buffered; the I/O layer may instead write the rest of the payload straight
  into the destination's memory and report it with ``consume_payload(n)``.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgpack

from aiodist._errors import ProtocolError
from aiodist._wire.headers import MESSAGES, message_header
from aiodist._wire.messages import Packed

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB

MAGIC: Final = b"AD"
PROTOCOL_VERSION: Final = 2  # 2: heartbeats carry what a rank sent its peers
PREFIX: Final = struct.Struct("!2sBBIQ")

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Limits:
    """Largest header and payload a decoder accepts."""

    max_header_bytes: int = 1 * MiB
    max_payload_bytes: int = 16 * GiB


@dataclass(slots=True)  # not frozen: built per frame, and a frozen __init__ costs 3x
class Frame:
    """A frame's prefix and decoded header; ``payload_nbytes`` raw bytes follow it."""

    kind: int
    header: Any
    payload_nbytes: int


@dataclass(frozen=True, slots=True)
class PayloadChunk:
    """The next bytes of the current frame's payload."""

    data: bytes


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA: Final = _Sentinel("NEED_DATA")
CLOSED: Final = _Sentinel("CLOSED")
Event = Frame | PayloadChunk | _Sentinel

_COMPACT_AT = 256 * KiB
_JOIN_HEADER_BYTES = 16 * KiB


class _Packers(threading.local):
    # A Packer per thread: building one per header (``msgpack.packb``) was most of
    # the cost of encoding a small header.
    def __init__(self) -> None:
        self.pack = msgpack.Packer(use_bin_type=True).pack


_packers = _Packers()


def encode_frame(
    kind: int, header: Any, payload: Buffer | None = None, *, join_bytes: int = 0
) -> list[Buffer]:
    """Encode one frame as the buffers to hand to ``transport.writelines``.

    The payload is never copied, but one of at most ``join_bytes`` bytes: that
    one is joined to the prefix and the header, one buffer for one write (a
    small message's, as dask's comm joins them). Otherwise it is returned as
    given (a memoryview of a tensor stays one).
    """
    return _frame(kind, (_packers.pack(header),), payload, join_bytes)


def _frame(
    kind: int, body: Sequence[bytes], payload: Buffer | None, join_bytes: int = 0
) -> list[Buffer]:
    nbytes = 0 if payload is None else memoryview(payload).nbytes
    body_nbytes = len(body[0]) if len(body) == 1 else sum(map(len, body))
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, body_nbytes, nbytes)
    if body_nbytes > _JOIN_HEADER_BYTES:  # a big header (a member table) is not copied
        return [prefix, *body, payload] if nbytes else [prefix, *body]  # type: ignore[list-item]
    if not nbytes:
        return [b"".join((prefix, *body))]
    if nbytes <= join_bytes:
        return [b"".join((prefix, *body, payload))]  # type: ignore[arg-type]
    return [b"".join((prefix, *body)), payload]  # type: ignore[list-item]


def encode_message(msg: Any, payload: Buffer | None = None) -> list[Buffer]:
    """Encode a message dataclass (see ``messages``) as a frame.

    ``Packed`` fields are spliced in as they are: msgpack values concatenate, so
    an array header followed by each field's encoding is the array's encoding.
    """
    header = message_header(msg)
    if Packed not in map(type, header):
        return encode_frame(msg.KIND, header, payload)
    assert len(header) < 16, "fixarray headers only"
    body = [bytes((0x90 | len(header),))]
    pack = _packers.pack
    body += (v.data if type(v) is Packed else pack(v) for v in header)
    return _frame(msg.KIND, body, payload)


def frame_message(frame: Frame) -> Any:
    """The message dataclass a frame carries.

    Raises:
        ProtocolError: Unknown kind, or fields of the wrong number or type.
        FieldError: A field's value is out of range (see ``bounds``): a
            ``ProtocolError`` naming the field, and the request to refuse.
    """
    try:
        return MESSAGES.decode(frame.kind, frame.header)
    except ValueError as exc:
        raise ProtocolError(f"malformed {MESSAGES.name(frame.kind)} message: {exc}") from exc


class FrameDecoder:
    """Turn a byte stream, fed in chunks of any size, into frames.

    Example:
        >>> dec = FrameDecoder()
        >>> dec.receive_data(b"".join(encode_frame(65, [1, 2], b"xyz")))
        >>> dec.next_event()
        Frame(kind=65, header=[1, 2], payload_nbytes=3)
        >>> dec.next_event()
        PayloadChunk(data=b'xyz')
    """

    __slots__ = ("_buf", "_eof", "_error", "_limits", "_payload_left", "_pos")

    def __init__(self, limits: Limits | None = None) -> None:
        self._limits = limits or Limits()
        self._buf = bytearray()
        self._pos = 0
        self._payload_left = 0
        self._eof = False
        self._error: ProtocolError | None = None

    @property
    def limits(self) -> Limits:
        return self._limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        """Change the limits from the next frame on (a peer that proved itself gets more)."""
        self._limits = limits

    @property
    def payload_remaining(self) -> int:
        """Payload bytes of the current frame not yet handed out or consumed."""
        return self._payload_left

    @property
    def buffered_nbytes(self) -> int:
        """Bytes received but not yet turned into events."""
        return len(self._buf) - self._pos

    def receive_data(self, data: Buffer) -> None:
        """Add received bytes; ``b""`` means the peer closed the connection."""
        if self._eof:
            raise RuntimeError("receive_data() after EOF")
        if not data:
            self._eof = True
        else:
            self._buf += data

    def consume_payload(self, nbytes: int) -> None:
        """Record ``nbytes`` of payload that the I/O layer read straight into place."""
        if self.buffered_nbytes:
            raise RuntimeError("drain buffered payload with next_event() first")
        if not 0 <= nbytes <= self._payload_left:
            raise ValueError(f"consume_payload({nbytes}) with {self._payload_left} left")
        self._payload_left -= nbytes

    def take_payload(self, dest: memoryview) -> int:
        """Copy buffered payload bytes of the current frame into ``dest``; return how many.

        As many as are buffered, up to ``len(dest)`` and the payload's end: what
        ``PayloadChunk`` events would carry, written where they belong without an
        event or a copy of their own.
        """
        n = min(len(self._buf) - self._pos, self._payload_left, dest.nbytes)
        if n > 0:
            pos = self._pos
            dest[:n] = memoryview(self._buf)[pos : pos + n]
            self._advance(n)
            self._payload_left -= n
        return max(n, 0)

    def frames(self, data: Buffer) -> Iterator[Frame]:
        """Feed ``data``; yield the whole frames it completes (the stream protocols' loop).

        For decoders whose limits allow no payload (the control plane's): every
        event is then a ``Frame``. Stops at ``NEED_DATA`` or ``CLOSED``.

        Raises:
            ProtocolError: The stream is malformed; close the connection.
        """
        self.receive_data(data)
        while (event := self.next_event()) is not NEED_DATA and event is not CLOSED:
            assert isinstance(event, Frame)  # no payload passes the limits
            yield event

    def next_event(self) -> Event:
        """The next ``Frame`` or ``PayloadChunk``, else ``NEED_DATA`` or ``CLOSED``.

        Raises:
            ProtocolError: The stream is malformed; close the connection.
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except ProtocolError as exc:
            self._error = exc
            raise

    def _next_event(self) -> Event:
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if self._payload_left:
            if not avail:
                return self._need_data()
            n = min(avail, self._payload_left)
            chunk = bytes(buf[pos : pos + n])
            self._advance(n)
            self._payload_left -= n
            return PayloadChunk(chunk)
        if avail < PREFIX.size:
            return self._need_data()
        magic, version, kind, header_nbytes, payload_nbytes = PREFIX.unpack_from(buf, pos)
        if magic != MAGIC:
            raise ProtocolError(
                f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not an aiodist peer"
            )
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (this side speaks "
                f"{PROTOCOL_VERSION}); run the same aiodist version everywhere"
            )
        limits = self._limits
        if header_nbytes > limits.max_header_bytes:
            raise ProtocolError(
                f"header of {header_nbytes} bytes exceeds the limit of "
                f"{limits.max_header_bytes} bytes"
            )
        if payload_nbytes > limits.max_payload_bytes:
            raise ProtocolError(
                f"payload of {payload_nbytes} bytes exceeds the limit of "
                f"{limits.max_payload_bytes} bytes"
            )
        end = pos + PREFIX.size + header_nbytes
        if len(buf) < end:
            return self._need_data()
        try:
            # A bytearray slice copies the (small) header, so the buffer can compact later.
            header = msgpack.unpackb(buf[pos + PREFIX.size : end], raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable {MESSAGES.name(kind)} header: {exc}") from exc
        self._advance(PREFIX.size + header_nbytes)
        self._payload_left = payload_nbytes
        return Frame(kind, header, payload_nbytes)

    def _advance(self, n: int) -> None:
        self._pos += n
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_AT:
            del self._buf[: self._pos]
            self._pos = 0

    def _need_data(self) -> _Sentinel:
        if not self._eof:
            return NEED_DATA
        if self._payload_left or self.buffered_nbytes:
            raise ProtocolError("connection closed in the middle of a frame")
        return CLOSED
