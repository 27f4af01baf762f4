"""The shared board's memory (see ``_metrics.board``): counters, then slots.

A board's segment holds ``size`` counters of ``COUNTER_BYTES``, one per rank
(how many syncs that rank has copied out, alone on a cache line), then
``DEPTH`` rows of ``size`` slots of ``SLOT_BYTES``: rank ``r``'s slot of sync
``i`` is row ``i % DEPTH``, column ``r``.

A slot is ``[stamp u64 | seq u64 | nbytes u32 | crc u32 | record]``, the stamp
(``i + 1``) written last. x86 keeps stores in program order, so a stamp seen
means the bytes it stamps are there. Elsewhere (``CHECKSUM``) the CRC of the
sync's index and the record catches a stamp seen before its bytes, and the
slot is read again later. A record that does not fit is written as its
length alone (``OVERSIZE``): every rank then fails that sync alike.
"""

from __future__ import annotations

import platform
import struct
import zlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    from aiodist._metrics.record import Single

__all__ = ["DEPTH", "MAX_RECORD_BYTES", "SLOT_BYTES", "Slots", "nbytes"]

#: Syncs a rank may be ahead of the slowest before its writes wait on a backlog.
DEPTH: Final = 64
SLOT_BYTES: Final = 16 * 1024
HEAD: Final = struct.Struct("<QQII")  # stamp (index + 1), seq, nbytes, crc
TAIL: Final = struct.Struct("<QII")  # the head without its stamp: written first
STAMP: Final = struct.Struct("<Q")
COUNTER_BYTES: Final = 64
#: The largest encoded record a rank may write per sync (about five hundred metrics).
MAX_RECORD_BYTES: Final = SLOT_BYTES - HEAD.size
OVERSIZE: Final = 0xFFFFFFFF
# Total store order: no checksum needed to trust a stamped slot.
CHECKSUM: Final = platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686"}


def nbytes(world_size: int) -> int:
    """The size of a board's segment for ``world_size`` ranks."""
    return world_size * (COUNTER_BYTES + DEPTH * SLOT_BYTES)


class Slots:
    """A board's segment as one rank writes and reads it."""

    __slots__ = ("_mem", "_rank", "_size", "_slots_at")

    def __init__(self, memory: memoryview, rank: int, size: int) -> None:
        self._mem = memory
        self._rank, self._size = rank, size
        self._slots_at = size * COUNTER_BYTES

    def offset(self, index: int, rank: int) -> int:
        """Where ``rank``'s slot of sync ``index`` starts."""
        return self._slots_at + ((index % DEPTH) * self._size + rank) * SLOT_BYTES

    def write(self, index: int, seq: int, data: bytes | None) -> None:
        """Write this rank's record of sync ``index`` (None: it did not fit), then stamp it."""
        off = self.offset(index, self._rank)
        mem = self._mem
        if data is None:
            size, crc = OVERSIZE, 0
        else:
            size = len(data)
            mem[off + HEAD.size : off + HEAD.size + size] = data
            crc = zlib.crc32(data, index & 0xFFFFFFFF) if CHECKSUM else 0
        TAIL.pack_into(mem, off + STAMP.size, seq, size, crc)
        STAMP.pack_into(mem, off, index + 1)  # last: the slot is whole once stamped

    def write_single(
        self, index: int, seq: int, single: Single, weight: float, values: Sequence[float]
    ) -> None:
        """``write`` of ``single.encode(weight, values)``, in one packing where it can."""
        if CHECKSUM:
            self.write(index, seq, single.encode(weight, values))
            return
        off = self.offset(index, self._rank)
        packer = single.slot
        if packer is None:  # the head after the stamp, then the record
            packer = single.slot = struct.Struct(
                f"{TAIL.format}{len(single.prefix)}s{single.count + 1}d"
            )
        packer.pack_into(
            self._mem, off + STAMP.size, seq, single.nbytes, 0, single.prefix, weight, *values
        )
        STAMP.pack_into(self._mem, off, index + 1)  # last: the slot is whole once stamped

    def read(self, index: int) -> list[tuple[int, bytes | None]] | None:
        """Every rank's (seq, record) of sync ``index``, or None while one is missing."""
        mem = self._mem
        stamp = index + 1
        base = self.offset(index, 0)
        offsets = range(base, base + self._size * SLOT_BYTES, SLOT_BYTES)
        for off in offsets:
            if STAMP.unpack_from(mem, off)[0] != stamp:
                return None
        rows: list[tuple[int, bytes | None]] = []
        for off in offsets:
            _, seq, size, crc = HEAD.unpack_from(mem, off)
            if size == OVERSIZE:
                rows.append((seq, None))
                continue
            if size > MAX_RECORD_BYTES:
                return None  # a torn head: read again later
            data = bytes(mem[off + HEAD.size : off + HEAD.size + size])
            if CHECKSUM and zlib.crc32(data, index & 0xFFFFFFFF) != crc:
                return None  # being written, or not visible yet: read again later
            rows.append((seq, data))
        return rows

    def slowest_copied(self) -> int:
        """The fewest syncs any rank has copied out."""
        mem = self._mem
        return min(int(STAMP.unpack_from(mem, r * COUNTER_BYTES)[0]) for r in range(self._size))

    def publish_copied(self, copied: int) -> None:
        """Tell every rank that this one copied out syncs ``[0, copied)``."""
        STAMP.pack_into(self._mem, self._rank * COUNTER_BYTES, copied)
