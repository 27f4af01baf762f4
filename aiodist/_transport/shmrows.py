"""A rank's rows segment: the memory its small collectives are written to (``_ops.board``).

Each rank of a host with shared memory on makes one segment when its data
plane starts listening, and publishes its name among its addresses
(``shm:rows:<name>``, a promise like ``shm.capability()``, not an address to
connect to). Peers map it when a collective first needs it. Only its owner
writes it; the file stays linked while the plane lives (named after the
owner's pid, so ``shm.remove_stale`` removes it after a crash).

Layout, every number a native ``int64`` at an 8-byte boundary:

- ``acks``: ``MAX_RANKS x SLOTS`` keys. The owner writes there which of rank
  ``w``'s rows it has finished reading: entry ``(w, i)`` holds the key of the
  row it last took from ``w``'s slot ``i``;
- ``tags``: ``SLOTS`` keys, the operation each slot holds now (0: none);
- ``asleep``: 1 while the owner waits for rows without polling: a rank that
  writes a row then rings it (``MatchKind.BELL``), on its own cache line;
- ``SLOTS`` slots: a signature's length and a row's length (two ``uint32``),
  8 bytes of padding, the signature (up to ``SIG_MAX`` bytes, msgpack), then
  the row (up to ``ROW_MAX`` bytes).

A key is one ``int64`` naming a group's operation (``key``), so one store
publishes a slot whole: a reader never sees half of it. The owner writes the
slot first and its tag last, and writes a slot again only once every reader
acknowledged it (or the operation failed); where stores are seen in the
order they were made (``shm.STORES_IN_ORDER``) and a 64-bit process stores
a key in one go, that is all the ordering needed. Other machines keep their
small collectives on sockets (``supported``).
"""

from __future__ import annotations

import struct
import sys
from typing import Final

from aiodist._transport import shm

#: Rows per rank in flight at once (across all its groups).
SLOTS: Final = 16
#: Ranks of a job whose rows a segment acknowledges: larger groups keep to sockets.
MAX_RANKS: Final = 64
#: The largest row a slot holds; a larger one's signature goes through the board and its
#: bytes through sockets.
ROW_MAX: Final = 16 * 1024
#: The largest signature a slot holds (msgpack); a collective with a longer one keeps to
#: sockets.
SIG_MAX: Final = 240
_SLOT_HEAD: Final = 16
ACKS: Final = 0
TAGS: Final = ACKS + MAX_RANKS * SLOTS * 8
ASLEEP: Final = TAGS + SLOTS * 8
_SLOTS_AT: Final = ASLEEP + 64
_SLOT_BYTES: Final = _SLOT_HEAD + SIG_MAX + ROW_MAX
NBYTES: Final = _SLOTS_AT + SLOTS * _SLOT_BYTES
#: What a rank publishes among its addresses before its segment's name.
PREFIX: Final = "shm:rows:"
_GROUP_BITS: Final = 20
_SEQ_BITS: Final = 63 - _GROUP_BITS
_SEQ_LIMIT: Final = 1 << (_SEQ_BITS - 1)
_KEY_MASK: Final = (1 << _SEQ_BITS) - 1
SLOT_HEAD: Final = struct.Struct("=II")


def supported() -> bool:
    """Stores seen in order, keys stored whole (a 64-bit process), shared memory on."""
    return shm.STORES_IN_ORDER and sys.maxsize > 2**32 and shm.available()


def create() -> shm.Segment:
    """This rank's rows segment (``shm.create_segment``; linked until closed)."""
    return shm.create_segment(NBYTES)


def address(segment: shm.Segment) -> str:
    return PREFIX + segment.name


def name_in(addresses: tuple[str, ...]) -> str | None:
    """The rows segment a peer published among ``addresses``, if any."""
    for a in addresses:
        if a.startswith(PREFIX):
            return a[len(PREFIX) :]
    return None


def key(group_id: int, seq: int) -> int:
    """One ``int64`` for operation ``seq`` of group ``group_id`` (0 if it has none)."""
    if not 0 <= group_id < 1 << _GROUP_BITS or not -_SEQ_LIMIT < seq < _SEQ_LIMIT or not seq:
        return 0
    return (group_id << _SEQ_BITS) | (seq & _KEY_MASK)


def slot_at(i: int) -> int:
    """Where slot ``i`` starts: its head, then its signature at ``+ 16``, its row after."""
    return _SLOTS_AT + i * _SLOT_BYTES
