"""The match key every data-plane message carries, and its kinds (sans-IO).

A ``DATA`` frame's header starts with the key ``(kind, group, a, b)``; a receive
names the key it wants, and messages from one source with one key match
receives in send order, as MPI matches them:

    kind          a                          b
    P2P           the user's tag             0
    COLLECTIVE    the call's sequence number the step within the call
    OBJECT_P2P    the tag                    0
    CLEAR         (a large p2p payload's clear-to-send, see ``_plane/bulk.py``)
    BULK          (that payload)
    CREDIT        (a receive posted before its announcement)
    RPC           (remote calls: requests, replies and their tensors)

A collective's sequence number is its call's place in its group's order, or,
for the parts of a call that runs several collectives inside, a negative
number that encodes the call and the part (``sub_seq``).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

Key = tuple[int, int, int, int]


class MatchKind(IntEnum):
    """What a message is for: the first field of its match key."""

    P2P = 0
    COLLECTIVE = 1
    OBJECT_P2P = 2
    CLEAR = 3
    BULK = 4
    CREDIT = 5
    RPC = 6
    BELL = 7  # a header alone: the sender wrote rows this rank may wait for (``_ops.board``)


# Parts of one call (see sub_seq): at most 2**20 collectives inside one call.
_PART_BITS: Final = 20


def sub_seq(call: int, part: int) -> int:
    """The sequence number of part ``part`` of call ``call``: negative, unique to the pair."""
    assert call > 0
    assert 0 <= part < 1 << _PART_BITS
    return -((call << _PART_BITS) | part)


def call_of(seq: int) -> int:
    """The call a collective's sequence number belongs to (itself, unless a ``sub_seq``)."""
    return seq if seq >= 0 else (-seq) >> _PART_BITS
