"""The shared board's memory (see ``_metrics.board``): two counter rows, then buckets.

Syncs go in *buckets* of ``GROUP`` consecutive indices (bucket ``b`` holds syncs
``GROUP * b`` to ``GROUP * b + GROUP - 1``). Each rank owns ``BUCKETS`` bucket
slots in its own region; bucket ``b`` goes into slot ``b % BUCKETS``. A rank
writes the syncs of one bucket side by side, so a batch of records costs a few
large stores rather than a few small ones per record::

    [ written: u64 per rank | copied: u64 per rank ]     each row padded to a cache line
    [ rank 0: BUCKETS bucket slots | rank 1: ... ]

    bucket slot: [ used u64 | seqs | runs | crcs | run table | data ]
        seqs:      GROUP x u64, each sync's sequence number
        runs:      GROUP x u8, the run each sync's record belongs to
        crcs:      GROUP x u32, each record's CRC (``CHECKSUM`` only)
        run table: GROUP x [ kind u32 | first u32 | offset u32 | nbytes u32 | prefix u32 ]

A *run* is what one write put in the slot's data, by ``kind``:

- ``RECORD``: one sync's record, ``nbytes`` bytes at ``offset``;
- ``VALUES``: the lone updates of syncs ``first, first + 1, ...``, all of one key
  set: its single encoding's prefix (``record.Single``) once at ``prefix``,
  then each update's numbers, ``nbytes`` apiece from ``offset`` on. A bucket
  of per-step syncs is one such run: a few stores, whatever its length;
- ``OVERSIZE``: one sync whose record did not fit: every rank fails it alike.

``used`` is where the rank's next run in that slot goes, so data ``[0, used)``
holds every record written there.

``written[r]``: rank ``r`` has written every sync below it, stored after the
records it counts. Where stores are seen in the order they were made
(``shm.STORES_IN_ORDER``: x86), a count seen means the bytes it counts are
there. Elsewhere (``CHECKSUM``) each record carries its CRC, seeded with the
sync's index, and one that does not check out is read again later.

``copied[r]``: rank ``r`` has copied out every sync below it. A bucket slot is
written again only once every rank has copied out the bucket it held.
"""

from __future__ import annotations

import struct
import zlib
from itertools import chain
from typing import TYPE_CHECKING, Final

from aiodist._metrics import record
from aiodist._transport import shm

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from aiodist._metrics.record import Record, Single

#: Syncs per bucket.
GROUP: Final = 16
#: Bucket slots per rank.
BUCKETS: Final = 8
#: Syncs a rank may be ahead of the slowest before its writes wait on a backlog.
DEPTH: Final = GROUP * BUCKETS
#: The largest encoded record a rank may write per sync (about five hundred metrics).
MAX_RECORD_BYTES: Final = 16 * 1024 - 32
RECORD, OVERSIZE, VALUES = 0, 1, 2
LINE: Final = 64
COUNT: Final = struct.Struct("<Q")
RUN: Final = struct.Struct("<5I")  # kind, first, offset, nbytes, prefix
_SEQS: Final = COUNT.size
_RUNS: Final = _SEQS + GROUP * 8
_CRCS: Final = _RUNS + GROUP
_TABLE: Final = _CRCS + GROUP * 4
_DATA: Final = _TABLE + GROUP * RUN.size
SLOT_BYTES: Final = _DATA + GROUP * MAX_RECORD_BYTES
# Where stores may be seen out of order, records carry a CRC, checked when copied out.
CHECKSUM: Final = not shm.STORES_IN_ORDER

# Packings of k sequence numbers, CRCs and runs, by k (0 unused).
_SEQ_RUNS: Final = [struct.Struct(f"<{k}Q") for k in range(GROUP + 1)]
_CRC_RUNS: Final = [struct.Struct(f"<{k}I") for k in range(GROUP + 1)]
_RUN_RUNS: Final = [struct.Struct("<" + RUN.format[1:] * k) for k in range(GROUP + 1)]


def _row_bytes(size: int) -> int:
    return -(-size * COUNT.size // LINE) * LINE


def nbytes(world_size: int) -> int:
    """The size of a board's segment for ``world_size`` ranks."""
    return 2 * _row_bytes(world_size) + world_size * BUCKETS * SLOT_BYTES


class Chunk:
    """One rank's records of syncs ``[start, stop)``, copied out of its bucket slot."""

    __slots__ = ("_base", "_data", "_runs", "_table", "crcs", "seqs", "start")

    def __init__(
        self,
        start: int,
        seqs: tuple[int, ...],
        runs: bytes,
        table: bytes,
        data: bytes,
        base: int,
        crcs: tuple[int, ...] = (),
    ) -> None:
        self.start = start
        self.seqs = seqs
        self._runs = runs  # the run of each sync from ``start`` on
        self._table = table  # the slot's whole run table
        self._data = data  # the slot's data from ``base`` on
        self._base = base
        self.crcs = crcs

    def record(self, index: int) -> tuple[int, bytes | None]:
        """(seq, record) of sync ``index``; None for a record that did not fit."""
        k = index - self.start
        kind, first, offset, size, prefix = RUN.unpack_from(self._table, self._runs[k] * RUN.size)
        seq = self.seqs[k]
        if kind == OVERSIZE:
            return seq, None
        data, base = self._data, self._base
        if kind == VALUES:  # the update's numbers after its key set's prefix
            at = offset + ((index - first) & 0xFFFFFFFF) * size - base
            p = prefix - base
            return seq, data[p : p + record.prefix_length(data, p)] + data[at : at + size]
        return seq, data[offset - base : offset - base + size]


class Slots:
    """A board's segment as one rank writes and reads it."""

    __slots__ = (
        "_copied",
        "_counts",
        "_mem",
        "_owner",
        "_rank",
        "_regions",
        "_runs",
        "_size",
        "_used",
    )

    def __init__(self, memory: memoryview, rank: int, size: int) -> None:
        self._mem = memory
        self._rank, self._size = rank, size
        row = _row_bytes(size)
        self._copied = row
        self._counts = struct.Struct(f"<{size}Q")  # a whole counter row in one call
        self._regions = [2 * row + r * BUCKETS * SLOT_BYTES for r in range(size)]
        # Which bucket each of this rank's slots holds, its data used and runs written.
        self._owner = [-1] * BUCKETS
        self._used = [0] * BUCKETS
        self._runs = [0] * BUCKETS

    @property
    def memory(self) -> memoryview:
        return self._mem

    def slot(self, index: int, rank: int) -> int:
        """Where ``rank``'s bucket slot holding sync ``index`` starts."""
        return self._regions[rank] + (index // GROUP % BUCKETS) * SLOT_BYTES

    # --- writing (this rank's region) --------------------------------------------------------

    def claim(self, first: int) -> tuple[int, int]:
        """(where the data of sync ``first``'s bucket slot starts, how much of it is used)."""
        bucket = first // GROUP
        j = bucket % BUCKETS
        if self._owner[j] != bucket:  # every rank copied out the bucket it held
            self._owner[j], self._used[j], self._runs[j] = bucket, 0, 0
        return self._regions[self._rank] + j * SLOT_BYTES + _DATA, self._used[j]

    def commit_values(
        self, first: int, seqs: Sequence[int], prefix: int, offset: int, size: int
    ) -> None:
        """Enter the lone updates of syncs ``first, first + 1, ...`` (one bucket) as one run.

        The data holds the key set's prefix at ``prefix`` and each update's
        ``size`` bytes of numbers from ``offset`` on (``Single.pack_values``).
        """
        run = (VALUES, first & 0xFFFFFFFF, offset, size, prefix)
        self._commit(first, seqs, [run], offset + len(seqs) * size)

    def commit_records(
        self, first: int, seqs: Sequence[int], sizes: Sequence[int | None], offset: int
    ) -> None:
        """Enter the records of syncs ``first, first + 1, ...`` (one bucket), one run each.

        Their bytes lie side by side from ``offset`` on, ``sizes`` bytes each
        (None: a record that did not fit, and has no bytes).
        """
        runs = []
        for i, size in enumerate(sizes):
            if size is None:
                runs.append((OVERSIZE, 0, offset, 0, offset))
            else:
                runs.append((RECORD, (first + i) & 0xFFFFFFFF, offset, size, offset))
                offset += size
        self._commit(first, seqs, runs, offset)

    def _commit(
        self, first: int, seqs: Sequence[int], runs: Sequence[tuple[int, ...]], used: int
    ) -> None:
        # The syncs count as written only once ``publish_written`` says so.
        j = first // GROUP % BUCKETS
        base = self._regions[self._rank] + j * SLOT_BYTES
        mem, k, at, rid = self._mem, len(seqs), first % GROUP, self._runs[j]
        _RUN_RUNS[len(runs)].pack_into(mem, base + _TABLE + rid * RUN.size, *chain(*runs))
        ids = bytes([rid]) * k if len(runs) == 1 else bytes(range(rid, rid + k))
        mem[base + _RUNS + at : base + _RUNS + at + k] = ids
        _SEQ_RUNS[k].pack_into(mem, base + _SEQS + at * 8, *seqs)
        COUNT.pack_into(mem, base, used)
        self._used[j], self._runs[j] = used, rid + len(runs)
        if CHECKSUM:
            chunk = self._chunk(first, first + k, self._rank, check=False)
            assert chunk is not None
            crcs = [_crc(chunk, index) for index in range(first, first + k)]
            _CRC_RUNS[k].pack_into(mem, base + _CRCS + at * 4, *crcs)

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

    def written_by(self, ranks: list[int]) -> int:
        """The fewest syncs any of ``ranks`` (group ranks) has written."""
        counts: tuple[int, ...] = self._counts.unpack_from(self._mem, 0)
        return min(counts[r] for r in ranks)

    def slowest_copied(self) -> int:
        """The fewest syncs any rank has copied out."""
        counts: tuple[int, ...] = self._counts.unpack_from(self._mem, self._copied)
        return min(counts)

    def copy(self, start: int, stop: int) -> list[Chunk] | None:
        """Every rank's records of syncs ``[start, stop)`` (complete, in one bucket).

        None when a record does not check out yet (``CHECKSUM``): read again later.
        """
        chunks = []
        for rank in range(self._size):
            chunk = self._chunk(start, stop, rank, check=CHECKSUM)
            if chunk is None:
                return None
            chunks.append(chunk)
        return chunks

    def _chunk(self, start: int, stop: int, rank: int, *, check: bool) -> Chunk | None:
        mem, k, at = self._mem, stop - start, start % GROUP
        base = self.slot(start, rank)
        seqs = _SEQ_RUNS[k].unpack_from(mem, base + _SEQS + at * 8)
        runs = bytes(mem[base + _RUNS + at : base + _RUNS + at + k])
        table = bytes(mem[base + _TABLE : base + _DATA])
        low, high = SLOT_BYTES, 0
        for rid in set(runs):  # the data of every run these syncs belong to
            kind, first, offset, size, prefix = RUN.unpack_from(table, rid * RUN.size)
            if kind == VALUES:
                # Only the updates of [start, stop): the run may reach beyond.
                low = min(low, prefix)
                end = offset + ((stop - first) & 0xFFFFFFFF) * size
            else:
                low, end = min(low, offset), offset + size
            high = max(high, end)
        data = bytes(mem[base + _DATA + low : base + _DATA + high])
        crcs = _CRC_RUNS[k].unpack_from(mem, base + _CRCS + at * 4) if check else ()
        chunk = Chunk(start, seqs, runs, table, data, low, crcs)
        if check and any(_crc(chunk, i) != crcs[i - start] for i in range(start, stop)):
            return None  # being written, or not visible yet: read again later
        return chunk

    def seq(self, index: int) -> int:
        """The sequence number this rank wrote with sync ``index``."""
        at = self.slot(index, self._rank) + _SEQS + index % GROUP * 8
        return int(COUNT.unpack_from(self._mem, at)[0])

    def write_run(
        self,
        first: int,
        seqs: Sequence[int],
        records: Sequence[Record],
        single_encoding: Callable[[tuple[str, ...]], Single] | None,
    ) -> None:
        """Write and commit this rank's ``records`` of syncs ``first, first + 1, ...`` (one bucket).

        ``single_encoding`` encodes a lone update's key set (``record.Single``).
        """
        memory = self.memory
        base, used = self.claim(first)
        k = len(records)
        head = records[0]
        if type(head) is tuple and list(map(type, records)).count(tuple) == k:
            # Lone updates, most likely all of one key set (a sync every step): its prefix
            # once, then every update's numbers, in a few calls whatever their number.
            keys, numbers = zip(*records, strict=True)
            names = head[0]
            assert single_encoding is not None
            single = single_encoding(names)
            if single.nbytes <= MAX_RECORD_BYTES and keys.count(names) == k:
                at = used + len(single.prefix)
                memory[base + used : base + at] = single.prefix
                single.pack_values(memory, base + at, numbers)
                self.commit_values(first, seqs, used, at, single.values_bytes)
                return
        encoded = [_encode(record, single_encoding) for record in records]
        data = b"".join(e for e in encoded if e is not None)
        memory[base + used : base + used + len(data)] = data
        self.commit_records(first, seqs, [None if e is None else len(e) for e in encoded], used)


def _encode(
    record: Record, single_encoding: Callable[[tuple[str, ...]], Single] | None
) -> bytes | None:
    """``record`` as written; None if it does not fit."""
    if type(record) is tuple:
        names, numbers = record
        assert single_encoding is not None
        single = single_encoding(names)
        return single.encode(numbers) if single.nbytes <= MAX_RECORD_BYTES else None
    assert isinstance(record, bytes)
    return record if len(record) <= MAX_RECORD_BYTES else None


def _crc(chunk: Chunk, index: int) -> int:
    data = chunk.record(index)[1]
    return 0 if data is None else zlib.crc32(data, index & 0xFFFFFFFF)
