"""The shared-memory ring's own frames: their kinds, the ring's limits, and the checks.

Sans-IO (``shmring.py`` moves the bytes): each ``parse_*`` function takes a
frame's header as the peer sent it and returns its fields once every one of
them has the type and the range it must have, or raises ``ProtocolError``.
Nothing a peer sends is computed with before that: a ring's size is at most
``MAX_SLOTS`` times ``MAX_SLOT_BYTES``, a chunk lies inside its slot and its
payload, a freed slot is one of the ring's.

    RING_HELLO [uid]                   I can receive through rings (both ends say it)
    RING_DATA  [kind, header, n, ring] frame (kind, header) whose n-byte payload comes
                                       in RING_CHUNKs; ring = [name, slots, slot_bytes]
                                       the first time, else None
    RING_CHUNK [slot, n]               the payload's next n bytes are in slot
    RING_FREE  [slot]                  (other direction) the receiver is done with slot
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from aiodist._errors import ProtocolError
from aiodist._wire.frame import MiB

# Frame kinds of the ring, above every message kind (``_wire/messages.py``: below 96).
RING_HELLO: Final = 96
RING_DATA: Final = 97
RING_CHUNK: Final = 98
RING_FREE: Final = 99
#: The largest ring a peer may announce (and a ``ShmTransport`` may make): 256 MiB.
MAX_SLOTS: Final = 16
MAX_SLOT_BYTES: Final = 16 * MiB
_MAX_NAME_CHARS: Final = 255  # a file name's limit


@dataclass(frozen=True, slots=True)
class Ring:
    """A ring a sender announced: the segment ``name``, of ``slots`` of ``slot_bytes``."""

    name: str
    slots: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class RingData:
    """A RING_DATA: frame ``kind`` with ``header``, ``nbytes`` of payload through ``ring``."""

    kind: int
    header: Any
    nbytes: int
    ring: Ring | None


def shown(value: Any) -> str:
    """A peer's value in an error message: an int as it is, anything else by its type."""
    return str(value) if type(value) is int else f"<{type(value).__name__}>"


def parse_ring_data(header: Any, max_payload_bytes: int) -> RingData:
    """The fields of a RING_DATA header, checked.

    Example:
        >>> parse_ring_data([65, ["meta"], 10, None], 1 << 20)
        RingData(kind=65, header=['meta'], nbytes=10, ring=None)
    """
    if not isinstance(header, list) or len(header) != 4:
        raise ProtocolError("malformed RING_DATA header")
    kind, inner, nbytes, announce = header
    if type(kind) is not int or not 0 <= kind < RING_HELLO:
        raise ProtocolError(f"RING_DATA for a frame of kind {shown(kind)}")
    if type(nbytes) is not int or not 0 < nbytes <= max_payload_bytes:
        raise ProtocolError(f"ring payload of {shown(nbytes)} bytes is out of bounds")
    return RingData(kind, inner, nbytes, None if announce is None else _ring(announce))


def _ring(announce: Any) -> Ring:
    if not isinstance(announce, list) or len(announce) != 3:
        raise ProtocolError("malformed ring announcement")
    name, slots, slot_bytes = announce
    if type(name) is not str or not 0 < len(name) <= _MAX_NAME_CHARS:
        raise ProtocolError(f"ring announcement names a segment by a {shown(name)}")
    if type(slots) is not int or not 1 <= slots <= MAX_SLOTS:
        raise ProtocolError(f"a ring of {shown(slots)} slots (at most {MAX_SLOTS})")
    if type(slot_bytes) is not int or not 1 <= slot_bytes <= MAX_SLOT_BYTES:
        raise ProtocolError(
            f"a ring of {shown(slot_bytes)}-byte slots (at most {MAX_SLOT_BYTES} bytes)"
        )
    return Ring(name, slots, slot_bytes)


def parse_ring_chunk(header: Any, ring: Ring, room: int) -> tuple[int, int]:
    """The ``(slot, n)`` of a RING_CHUNK into ``ring``, with ``room`` bytes of payload left.

    Example:
        >>> parse_ring_chunk([1, 100], Ring("r", 2, 4096), room=100)
        (1, 100)
    """
    if not isinstance(header, list) or len(header) != 2:
        raise ProtocolError("malformed RING_CHUNK header")
    slot, n = header
    if not (
        type(slot) is int
        and type(n) is int
        and 0 <= slot < ring.slots
        and 0 < n <= min(ring.slot_bytes, room)
    ):
        raise ProtocolError(f"RING_CHUNK [{shown(slot)}, {shown(n)}] out of bounds")
    return slot, n


def parse_ring_free(header: Any, slots: int) -> int:
    """The slot of a RING_FREE, one of ``slots``.

    Example:
        >>> parse_ring_free([3], 4)
        3
    """
    slot = header[0] if isinstance(header, list) and len(header) == 1 else None
    if type(slot) is not int or not 0 <= slot < slots:
        raise ProtocolError(f"RING_FREE for slot {shown(slot)}, which holds nothing sent")
    return slot
