"""The shared board's memory (see ``_metrics.board``): two counter rows, then buckets.

Syncs go in *buckets* of ``GROUP`` consecutive indices (bucket ``b`` holds syncs
``GROUP * b`` to ``GROUP * b + GROUP - 1``). Each rank owns ``BUCKETS`` bucket
slots in its own region; bucket ``b`` goes into slot ``b % BUCKETS``. A rank
writes the syncs of one bucket side by side, so a batch of records costs a few
large stores rather than a few small ones per record::

    [ written: u64 per rank | copied: u64 per rank ]     each row padded to a cache line
    [ rank 0: BUCKETS bucket slots | rank 1: ... ]

    bucket slot: [ used u64 | GROUP entries | data ]
    entry:       [ seq u64 | offset u32 | nbytes u32 | crc u32 | oversize u32 ]

Sync ``i``'s record from rank ``r`` is entry ``i % GROUP`` of that rank's slot:
``nbytes`` bytes at ``offset`` into its data (``oversize``: it did not fit, and
every rank fails that sync alike). ``used`` is where the rank's next record
in that slot goes, so data ``[0, used)`` holds every record written there.

``written[r]``: rank ``r`` has written every sync below it, stored after the
records and entries it covers. x86 keeps stores in program order, so a count
seen means the bytes it counts are there. Elsewhere (``CHECKSUM``) each entry
carries the CRC of its record, seeded with the sync's index, and a record that
does not check out is read again later.

``copied[r]``: rank ``r`` has copied out every sync below it. A bucket slot is
written again only once every rank has copied out the bucket it held.
"""

from __future__ import annotations

import platform
import struct
import zlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "BUCKETS",
    "CHECKSUM",
    "DEPTH",
    "GROUP",
    "MAX_RECORD_BYTES",
    "Chunk",
    "Slots",
    "nbytes",
]

#: Syncs per bucket.
GROUP: Final = 16
#: Bucket slots per rank.
BUCKETS: Final = 4
#: Syncs a rank may be ahead of the slowest before its writes wait on a backlog.
DEPTH: Final = GROUP * BUCKETS
#: The largest encoded record a rank may write per sync (about five hundred metrics).
MAX_RECORD_BYTES: Final = 16 * 1024 - 32
LINE: Final = 64
COUNT: Final = struct.Struct("<Q")
ENTRY: Final = struct.Struct("<QIIII")  # seq, offset, nbytes, crc, oversize
_TABLE: Final = COUNT.size
_DATA: Final = _TABLE + GROUP * ENTRY.size
SLOT_BYTES: Final = _DATA + GROUP * MAX_RECORD_BYTES
# Total store order: no checksum needed to trust a record whose count is seen.
CHECKSUM: Final = platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686"}

_entries: dict[int, struct.Struct] = {}  # ``ENTRY`` repeated k times, by k


def _entry_run(k: int) -> struct.Struct:
    run = _entries.get(k)
    if run is None:
        run = _entries[k] = struct.Struct("<" + ENTRY.format[1:] * k)
    return run


def _row_bytes(size: int) -> int:
    return -(-size * COUNT.size // LINE) * LINE


def nbytes(world_size: int) -> int:
    """The size of a board's segment for ``world_size`` ranks."""
    return 2 * _row_bytes(world_size) + world_size * BUCKETS * SLOT_BYTES


class Chunk:
    """One rank's records of syncs ``[start, stop)``, copied out of its bucket slot."""

    __slots__ = ("base", "data", "entries", "start")

    def __init__(self, start: int, entries: tuple[int, ...], data: bytes, base: int) -> None:
        self.start = start
        self.entries = entries  # ENTRY's fields, one run per sync
        self.data = data  # the slot's data from ``base`` on
        self.base = base

    def record(self, index: int) -> tuple[int, bytes | None]:
        """(seq, record) of sync ``index``; None for a record that did not fit."""
        e = (index - self.start) * 5
        seq, offset, size, _, oversize = self.entries[e : e + 5]
        if oversize:
            return seq, None
        at = offset - self.base
        return seq, self.data[at : at + size]


class Slots:
    """A board's segment as one rank writes and reads it."""

    __slots__ = ("_copied", "_counts", "_mem", "_owner", "_rank", "_regions", "_size", "_used")

    def __init__(self, memory: memoryview, rank: int, size: int) -> None:
        self._mem = memory
        self._rank, self._size = rank, size
        row = _row_bytes(size)
        self._copied = row
        self._counts = struct.Struct(f"<{size}Q")  # a whole counter row in one call
        self._regions = [2 * row + r * BUCKETS * SLOT_BYTES for r in range(size)]
        # Which bucket each of this rank's slots holds, and the data it used so far.
        self._owner = [-1] * BUCKETS
        self._used = [0] * BUCKETS

    def slot(self, index: int, rank: int) -> int:
        """Where ``rank``'s bucket slot holding sync ``index`` starts."""
        return self._regions[rank] + (index // GROUP % BUCKETS) * SLOT_BYTES

    def record_at(self, index: int, rank: int) -> int:
        """Where ``rank``'s record of sync ``index`` starts (once written)."""
        base = self.slot(index, rank)
        offset: int = ENTRY.unpack_from(self._mem, base + _TABLE + index % GROUP * ENTRY.size)[1]
        return base + _DATA + offset

    # --- writing (this rank's region) --------------------------------------------------------

    @property
    def memory(self) -> memoryview:
        return self._mem

    def claim(self, first: int) -> int:
        """Where in ``memory`` this rank's record of sync ``first`` goes; the next ones follow."""
        bucket = first // GROUP
        j = bucket % BUCKETS
        if self._owner[j] != bucket:  # every rank copied out the bucket it held
            self._owner[j], self._used[j] = bucket, 0
        return self._regions[self._rank] + j * SLOT_BYTES + _DATA + self._used[j]

    def commit(self, first: int, seqs: Sequence[int], sizes: Sequence[int | None]) -> None:
        """Enter this rank's records of syncs ``first, first + 1, ...`` (one bucket).

        Their bytes lie side by side from ``claim(first)`` on, ``sizes`` bytes
        each (None: a record that did not fit, and has no bytes). The syncs
        count as written only once ``publish_written`` says so.
        """
        j = first // GROUP % BUCKETS
        base = self._regions[self._rank] + j * SLOT_BYTES
        mem = self._mem
        used = self._used[j]
        fields: list[int] = []
        index = first
        for seq, size in zip(seqs, sizes, strict=True):
            if size is None:
                fields += (seq, used, 0, 0, 1)
            else:
                at = base + _DATA + used
                crc = zlib.crc32(mem[at : at + size], index & 0xFFFFFFFF) if CHECKSUM else 0
                fields += (seq, used, size, crc, 0)
                used += size
            index += 1
        _entry_run(len(seqs)).pack_into(mem, base + _TABLE + first % GROUP * ENTRY.size, *fields)
        COUNT.pack_into(mem, base, used)
        self._used[j] = used

    def publish_written(self, written: int) -> None:
        """Tell every rank that this one wrote syncs ``[0, written)``; after their records."""
        COUNT.pack_into(self._mem, self._rank * COUNT.size, written)

    def publish_copied(self, copied: int) -> None:
        """Tell every rank that this one copied out syncs ``[0, copied)``."""
        COUNT.pack_into(self._mem, self._copied + self._rank * COUNT.size, copied)

    # --- reading (every rank's region) -------------------------------------------------------

    def complete(self) -> int:
        """Syncs ``[0, n)`` every rank has written."""
        counts: tuple[int, ...] = self._counts.unpack_from(self._mem, 0)
        return min(counts)

    def slowest_copied(self) -> int:
        """The fewest syncs any rank has copied out."""
        counts: tuple[int, ...] = self._counts.unpack_from(self._mem, self._copied)
        return min(counts)

    def copy(self, start: int, stop: int) -> list[Chunk] | None:
        """Every rank's records of syncs ``[start, stop)`` (complete, in one bucket).

        None when a record does not check out yet (``CHECKSUM``): read again later.
        """
        mem = self._mem
        run = _entry_run(stop - start)
        chunks: list[Chunk] = []
        for rank in range(self._size):
            base = self.slot(start, rank)
            entries = run.unpack_from(mem, base + _TABLE + start % GROUP * ENTRY.size)
            offsets, sizes = entries[1::5], entries[2::5]
            low = min(offsets)
            high = max(map(int.__add__, offsets, sizes))
            data = bytes(mem[base + _DATA + low : base + _DATA + high])
            chunk = Chunk(start, entries, data, low)
            if CHECKSUM and not _checks_out(chunk, start, stop):
                return None
            chunks.append(chunk)
        return chunks

    def read(self, index: int) -> list[tuple[int, bytes | None]] | None:
        """Every rank's (seq, record) of sync ``index``, or None while one is missing."""
        if self.complete() <= index:
            return None
        chunks = self.copy(index, index + 1)
        return None if chunks is None else [chunk.record(index) for chunk in chunks]

    def seq(self, index: int) -> int:
        """The sequence number this rank wrote with sync ``index``."""
        base = self.slot(index, self._rank)
        return int(ENTRY.unpack_from(self._mem, base + _TABLE + index % GROUP * ENTRY.size)[0])


def _checks_out(chunk: Chunk, start: int, stop: int) -> bool:
    entries = chunk.entries
    for index in range(start, stop):
        e = (index - start) * 5
        data = chunk.record(index)[1]
        if data is not None and zlib.crc32(data, index & 0xFFFFFFFF) != entries[e + 3]:
            return False
    return True
